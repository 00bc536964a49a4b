"""Issue 17, the einsum API: each class of hostile input found by fuzzing gets a clear
TensorQLError (or, for well-formed input, numpy's answer)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tensorql as tq


@pytest.fixture
def db():
    with tq.connect() as session:
        yield session


@pytest.fixture
def x(db):
    return db.from_numpy("x", np.arange(3, dtype=np.float32))


def test_zero_d_literals_stay_zero_d(db, x):
    xs = np.arange(3, dtype=np.float32)
    np.testing.assert_allclose(tq.einsum(",i->i", 2.0, x).numpy(), np.einsum(",i->i", 2.0, xs))
    got = tq.einsum("...,i->...i", np.array(2.0), x).numpy()
    assert got.shape == np.einsum("...,i->...i", np.array(2.0), xs).shape == (3,)
    with pytest.raises(tq.ShapeError, match="operand 0 has 0 dim"):
        tq.einsum("j,i->ij", np.array(2.0), x)
    assert db.constant(np.float32(3)).shape == ()


@pytest.mark.parametrize("value, words", [
    (np.array(["a", "b", "c"]), "unsupported dtype"),
    (np.array([1, None, 3], dtype=object), "Python objects"),
    (np.array(["2020-01-01"] * 3, dtype="datetime64[D]"), "unsupported dtype"),
    (None, "None is not a tensor"),
    ([[1], [1, 2]], "ragged"),
    (np.ones(3, np.uint16), "unsupported dtype"),
])
def test_unusable_literals_name_the_operand(x, value, words):
    error = tq.errors.DTypeError if "dtype" in words else tq.ShapeError
    with pytest.raises(error, match=f"operand 1: .*{words}"):
        tq.einsum("i,i->i", x, value)


@pytest.mark.parametrize("tile, words", [("ab", "sequence of positive integers"),
                                         ((1.5,), "1.5, not a positive integer"),
                                         ((0,), "tiles must be >= 1"),
                                         ((True,), "not a positive integer")])
def test_bad_tiles_are_refused_before_storing(db, tile, words):
    with pytest.raises(tq.ShapeError, match=words):
        db.from_numpy("t", np.ones(4, np.float32), tile=tile)
    assert db.tensors() == []
    with pytest.raises(tq.errors.DTypeError):
        db.from_numpy("s", np.array(["a", "b"]))
    assert db.tensors() == []


@pytest.mark.parametrize("tile, words", [("ab", "sequence of positive integers"),
                                         ((0, 2), "tiles must be >= 1"),
                                         ((2,), "one tile size >= 1 per dimension")])
def test_bad_constant_tiles_name_the_problem(db, tile, words):
    with pytest.raises(tq.ShapeError, match=words):
        db.constant(np.ones((4, 2), np.float32), tile=tile)


def test_bool_times_int32_with_tiled_aggregated_label(db):
    rng = np.random.default_rng(0)
    b = rng.random((5, 6)) > 0.5
    i = rng.integers(-50, 50, 6, dtype=np.int32)
    B, Ii = db.from_numpy("b", b, tile=(2, 2)), db.from_numpy("i", i, tile=(3,))
    got = tq.einsum("ac,c->", B, Ii).numpy()
    assert got == np.einsum("ac,c->", b.astype(np.int64), i.astype(np.int64))


def test_int32_sums_accumulate_in_int64_like_torch_sum(db):
    big = db.from_numpy("big", np.full(4, 2**30, dtype=np.int32), tile=(2,))
    got = tq.einsum("i->", big).numpy()
    assert got.dtype == np.int64 and int(got) == 4 * 2**30  # numpy's int32 einsum wraps to 0
    rows = db.sql("SELECT * FROM EINSUM('i->', big)").fetchall()
    assert rows == [(4 * 2**30,)]
    assert tq.einsum("i->i", big).numpy().dtype == np.int32  # no aggregation: no widening


def test_absurd_task_counts_are_refused_with_the_reason(db):
    a = db.from_numpy("a", np.ones((300, 300), np.float32), tile=(1, 1))
    with pytest.raises(tq.PlanError, match=r"27,\d{3},\d{3} chunk tasks .* larger tiles"):
        (a @ a).numpy()
    small = db.from_numpy("s", np.ones((8, 8), np.float32), tile=(1, 1))  # few tasks: runs
    np.testing.assert_allclose((small @ small).numpy(), np.full((8, 8), 8.0))


@pytest.mark.parametrize("equation, agg", [("ij,j->i", "sum"), ("ij->j", "sum"),
                                           ("ij->j", "max"), ("ij->j", "prod"),
                                           ("ij,ij->ij", "sum"), ("ij->", "sum")])
def test_zero_size_dimensions_like_numpy(db, equation, agg):
    z = np.zeros((0, 3), np.float32)
    Z = db.from_numpy("z", z, tile=(2, 2))
    operands = [Z, db.from_numpy("w", np.arange(3, dtype=np.float32))] \
        if "," in equation and equation.split(",")[1].startswith("j") else [Z] * (
            equation.count(",") + 1)
    arrays = [o.numpy() for o in operands]
    got = tq.einsum(equation, *operands, agg=agg).numpy()
    identity = {"sum": 0.0, "prod": 1.0, "max": -np.inf}[agg]
    expected_shape = np.einsum(equation, *arrays).shape
    assert got.shape == expected_shape and got.dtype == np.float32
    assert np.all(got == identity)  # nothing contributes: the aggregation's identity
    assert db.store("s", tq.einsum(equation, *operands, agg=agg)).shape == expected_shape


# -- found by the session-7 fuzz of the Python surface (raw exceptions before) -------------

def test_a_name_that_is_not_a_string_is_an_unknown_tensor(db, x):
    # a number was bound as the catalog query's parameter: DuckDB cast the name column to
    # INT32 and raised its own ConversionException
    for bad in (3, 2.5, None, ("x",)):
        with pytest.raises(tq.UnknownTensorError, match="unknown tensor"):
            db.tensor(bad)
        with pytest.raises(tq.UnknownTensorError):
            db.drop(bad)
    assert db.tensors() == ["x"]
    np.testing.assert_array_equal(db.tensor("x").numpy(), np.arange(3, dtype=np.float32))


@pytest.mark.parametrize("value, words", [
    (torch.ones(3).to_sparse(), "sparse_coo tensor is not stored as such; pass tensor.to_dense"),
    (torch.ones(3, device="meta"), "meta device has no values"),
    ([1.0, 2.0], "expected a torch.Tensor, got list"),
])
def test_from_torch_refuses_what_has_no_dense_values(db, value, words):
    with pytest.raises(tq.UnsupportedError, match=words):
        db.from_torch("t", value)
    assert "t" not in db.tensors()


def test_a_join_sql_template_that_is_not_a_string_is_named(db):
    with pytest.raises(tq.JoinFunctionError, match="sql template must be a string.*int 3"):
        tq.register_join("plus_fuzz", lambda a, b: a + b, identity=0.0, sql=3)


@pytest.mark.parametrize("call, error, words", [
    (lambda t: t.sum(1.5), tq.UnsupportedError, "axis must be an integer"),
    (lambda t: t.max("x"), tq.UnsupportedError, "axis must be an integer"),
    (lambda t: t.softmax((0, 1)), tq.ShapeError, "takes one axis"),
    (lambda t: t.log_softmax(True), tq.UnsupportedError, "axis must be an integer"),
    (lambda t: t.argmax(()), tq.ShapeError, "takes one axis"),
    (lambda t: t.cumsum(5), tq.ShapeError, "out of range"),
    (lambda t: t[0, 0, 0], IndexError, "too many indices"),
    (lambda t: t[..., ...], IndexError, "single ellipsis"),
    (lambda t: t[7], IndexError, "out of bounds"),
])
def test_a_bad_axis_or_index_is_a_tensorql_error_naming_it(db, call, error, words):
    """Found by fuzzing the tensor methods: float, string and bool axes, several axes where
    one is taken, and bad indices reached Python's own errors; each is a TensorQLError now
    (an index error is an IndexError too, as numpy's)."""
    t = db.from_numpy("m", np.arange(6, dtype=np.float32).reshape(2, 3))
    with pytest.raises(error, match=words) as caught:
        call(t)
    assert isinstance(caught.value, tq.TensorQLError)
    assert t.sum(np.int64(1)).numpy().tolist() == [3.0, 12.0]  # numpy integers are axes
    assert [row.tolist() for row in t] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]  # iteration ends


def test_len_of_a_zero_d_tensor_is_a_tensorql_type_error(db):
    with pytest.raises(TypeError, match="0-d") as caught:
        len(db.constant(np.float32(2)))
    assert isinstance(caught.value, tq.TensorQLError)


@pytest.mark.parametrize("make, words", [
    (lambda db: tq.optim.Adam(db, 3), "names of stored weights"),
    (lambda db: tq.optim.Adam(db, ["w", "w"]), "more than once"),
    (lambda db: tq.optim.Adam(db, ["w"], lr="x"), "lr must be"),
    (lambda db: tq.optim.Adam(db, ["w"], lr=float("nan")), "lr must be"),
    (lambda db: tq.optim.SGD(db, ["w"], lr=-1), "lr must be"),
    (lambda db: tq.optim.Adam(db, ["w"], betas=(0.9,)), "betas must be a pair"),
    (lambda db: tq.optim.Adam(db, ["w"], betas=(1.5, 0.9)), r"betas\[0\] must be in \[0, 1\)"),
    (lambda db: tq.optim.AdamW(db, ["w"], eps=None), "eps must be"),
    (lambda db: tq.optim.AdamW(db, ["w"], weight_decay="x"), "weight_decay must be"),
    (lambda db: tq.optim.SGD(db, ["w"], momentum=-0.5), "momentum must be"),
    (lambda db: tq.optim.SGD(db, ["w"], checkpoint_every="x"), "checkpoint_every"),
    (lambda db: tq.optim.SGD(db, ["w"], name=""), "name must be"),
])
def test_bad_optimizer_settings_are_option_errors_and_store_nothing(db, make, words):
    """Found by fuzzing: strings, None, NaN and out-of-range values reached float() or
    unpacking; each is an OptionError naming the setting, as torch.optim's checks, and the
    weight and the stored tensors are unchanged."""
    w = np.array([1.0, -2.0], np.float32)
    db.from_numpy("w", w)
    before = sorted(db.tensors())
    with pytest.raises(tq.OptionError, match=words):
        make(db)
    assert sorted(db.tensors()) == before
    np.testing.assert_array_equal(db.tensor("w").numpy(), w)
    tq.optim.Adam(db, ["w"], lr=np.float32(0.1), betas=[0.8, 0.9])  # numpy floats, a list


def test_store_many_and_from_pandas_refuse_what_they_do_not_take(db):
    a = np.arange(4.0)
    with pytest.raises(tq.UnsupportedError, match="dict of name"):
        db.store_many([("x", a)])
    with pytest.raises(tq.UnsupportedError, match="pandas DataFrame or Series, not ndarray"):
        db.from_pandas("p", a)
    assert db.tensors() == []


def test_store_many_refuses_names_that_differ_only_in_case(db):
    """Found by fuzzing (s16): store_many({"Zz": ..., "ZZ": ...}) stored both, and DuckDB's
    case-insensitive ``SELECT ... FROM Zz`` then read ZZ's rows; every other way in refuses
    such a pair."""
    a = db.from_numpy("A", np.arange(6.0).reshape(2, 3))
    with pytest.raises(tq.StorageError, match="'Zz' and 'ZZ' differ only in case"):
        db.store_many({"Zz": a * 1, "ZZ": a * 2})
    assert db.tensors() == ["A"]
    db.store_many({"Zz": a * 1, "Yy": a * 2})
    assert db.sql("SELECT sum(val) FROM zz").fetchall() == [(15.0,)]


@pytest.mark.parametrize("settings, words", [
    (dict(workers="2"), "workers must be an integer"),
    (dict(workers=-1), "workers must be an integer"),
    (dict(intra_op_threads=10**15), "intra_op_threads must be an integer"),
    (dict(intra_op_threads=1.5), "intra_op_threads must be an integer"),
    (dict(tile_target_elems=0), "tile_target_elems must be a positive integer"),
    (dict(kernel_temp_bytes=float("nan")), "kernel_temp_bytes: cannot read memory size"),
    (dict(chunk_cache_bytes=float("inf")), "chunk_cache_bytes: cannot read memory size"),
    (dict(chunk_cache_bytes="x"), "chunk_cache_bytes: cannot read memory size"),
    (dict(memory_limit=True), "cannot read memory size True"),
    (dict(progress="yes"), "progress must be True or False"),
    (dict(distributed_timeout_s=0), "distributed_timeout_s must be a finite number"),
    (dict(distributed_timeout_s="x"), "distributed_timeout_s must be a finite number"),
    (dict(strategy=3), "strategy must be a non-empty string"),
    (dict(worker=2), "unknown option.*'worker' \\(did you mean 'workers'\\?\\)"),
])
def test_bad_connect_settings_are_option_errors_naming_the_setting(settings, words):
    """Found by fuzzing every Options field through connect(): strings, floats, NaN, huge
    numbers and misspelt names reached comparisons, int() or torch.set_num_threads (an
    overflow); each is an OptionError naming the setting now, before anything is opened."""
    with pytest.raises(tq.OptionError, match=words):
        tq.connect(devices="cpu", **settings)


def test_sizes_and_counts_that_are_fine_still_open_a_session():
    opts = tq.Options(workers=2, chunk_cache_bytes=0, kernel_temp_bytes="32MiB",
                      progress=1, distributed_timeout_s=5, intra_op_threads=np.int64(1))
    assert (opts.workers, opts.chunk_cache_bytes, opts.kernel_temp_bytes) == (2, 0, 32 << 20)
    assert opts.progress is True and opts.intra_op_threads == 1
    with tq.connect(devices="cpu", options=opts) as db:
        a = np.arange(6.0).reshape(2, 3)
        np.testing.assert_array_equal(db.from_numpy("a", a).sum(0).numpy(), a.sum(0))


def test_read_only_needs_a_tensor_database_that_exists(tmp_path):
    """Read-only over an in-memory database or a file with no tensorql catalog raised
    DuckDB's catalog error; it is a StorageError saying what read_only opens, and the file
    is left as it was."""
    import duckdb

    with pytest.raises(tq.StorageError, match="in-memory database read-only"):
        tq.connect(read_only=True)
    plain = tmp_path / "plain.duckdb"
    with duckdb.connect(str(plain)) as con:
        con.execute("CREATE TABLE t AS SELECT 1 AS x")
    with pytest.raises(tq.StorageError, match="holds no tensorql catalog"):
        tq.connect(str(plain), read_only=True)
    with duckdb.connect(str(plain)) as con:
        assert con.execute("SELECT table_name FROM duckdb_tables()").fetchall() == [("t",)]
    path = str(tmp_path / "t.duckdb")
    with tq.connect(path) as db:
        db.from_numpy("a", np.arange(3.0))
    with tq.connect(path, read_only=True) as db:
        assert db.tensor("a").numpy().tolist() == [0.0, 1.0, 2.0]


@pytest.mark.parametrize("path", [None, "file"])
def test_a_closed_session_is_a_storage_error_and_its_file_is_intact(tmp_path, path):
    """A tensor, expression or statement of a closed session raised DuckDB's
    ConnectionException ("Connection already closed!"); it is a StorageError saying the
    session is closed, and the file reopens with what it held."""
    where = str(tmp_path / "c.duckdb") if path else None
    db = tq.connect(where)
    a = db.from_numpy("a", np.arange(6.0).reshape(2, 3))
    doubled = a * 2
    db.close()
    for use in (a.numpy, doubled.numpy, lambda: np.add(a, 1), lambda: doubled.sum().item(),
                lambda: db.tensor("a"), db.tensors, lambda: db.sql("SELECT 1"),
                lambda: db.from_numpy("b", np.ones(2)), lambda: db.store("b", doubled),
                lambda: db.drop("a"), lambda: doubled.explain(analyze=True),
                lambda: list(db.iter_chunks("a"))):
        with pytest.raises(tq.StorageError, match="session is closed"):
            use()
    assert "closed" in repr(db)
    db.close()  # closing twice is fine
    if where:
        with tq.connect(where) as again:
            assert again.tensors() == ["a"]
            np.testing.assert_array_equal(again.tensor("a").numpy(),
                                          np.arange(6.0).reshape(2, 3))


def test_compute_and_store_many_refuse_another_sessions_tensors():
    """db.compute / db.store_many given a tensor of another session read this session's
    tensor of the same name (silently wrong values); they are UnsupportedErrors and store
    nothing, while db.store copies the other session's values as before."""
    a = np.arange(6.0).reshape(2, 3)
    with tq.connect() as db, tq.connect() as other:
        mine = db.from_numpy("a", a)
        theirs = other.from_numpy("a", a * 10)
        with pytest.raises(tq.UnsupportedError, match="expression 1 belongs to another"):
            db.compute(mine, theirs + 1)
        with pytest.raises(tq.UnsupportedError, match="another database"):
            db.store_many({"b": theirs + 1})
        assert db.tensors() == ["a"]
        np.testing.assert_array_equal(db.store("c", theirs * 2).numpy(), a * 20)
        np.testing.assert_array_equal(db.compute(mine * 2)[0].numpy(), a * 2)


def _fz_logaddexp(a, b):
    return torch.logaddexp(a, b)


def test_a_user_join_or_agg_identity_is_a_real_number(db):
    """register_join kept any identity ('x', [0], True) and register_agg refused numpy's
    scalars (np.float32(0) "is not a number"); both take a real number, numpy's too, as a
    float, and name anything else."""
    for bad in ("x", [0], True, torch.tensor(0.0)):
        with pytest.raises(tq.JoinFunctionError, match="identity must be a number"):
            tq.register_join("t_fz_ident", _fz_logaddexp, identity=bad)
        with pytest.raises(tq.AggFunctionError, match="identity must be a number"):
            tq.register_agg("t_fz_agg_ident", torch.maximum, identity=bad)
    assert "t_fz_ident" not in tq.algebra.JOINS
    tq.register_join("t_fz_ident", _fz_logaddexp, identity=np.float32(-np.inf))
    assert tq.algebra.JOINS["t_fz_ident"].identity == float("-inf")
    tq.register_agg("t_fz_agg_ident", torch.maximum, identity=np.float64(-np.inf))
    a = np.random.default_rng(4).standard_normal((3, 4))
    x = db.from_numpy("fa", a, tile=(2, 2))
    got = tq.einsum("ij->i", x, agg="t_fz_agg_ident").numpy()
    np.testing.assert_array_equal(got, a.max(axis=1))


def _fz_times_square(a, b):
    return a * b * b


@pytest.mark.parametrize("adjoint, words", [
    (lambda k, a, b: (a * b).sum(), "adjoint\\(0, ...\\): an output element depends"),
    (lambda k, a, b: (a * b * 10).to(torch.int64), "adjoint\\(0, ...\\) gives torch.int64"),
    (lambda k, a, b: b * b if k == 0 else (a * b).mean(), "adjoint\\(1, ...\\): an output"),
    (3, "adjoint int is not callable")])
def test_a_join_adjoint_that_is_no_gradient_is_refused_when_registered(db, adjoint, words):
    """A join's adjoint was called raw and its result broadcast: one returning a sum or an
    integer cast gave tq.grad a silently wrong gradient. register_join probes it as it probes
    the join (elementwise, a floating tensor, for every operand) and names the operand (one
    that raises is still tq.grad's GradientError: test_user_joins)."""
    with pytest.raises(tq.JoinFunctionError, match=words):
        tq.register_join("t_fz_adj", _fz_times_square, adjoint=adjoint)
    assert "t_fz_adj" not in tq.algebra.JOINS


def _fz_times_square_adjoint(k, a, b):
    return b * b if k == 0 else 2 * a * b


def test_a_join_adjoint_that_is_a_gradient_gives_torchs_gradient(db):
    tq.register_join("t_fz_adj_ok", _fz_times_square, adjoint=_fz_times_square_adjoint)
    a = np.random.default_rng(5).uniform(0.5, 1.5, (3, 4))
    x = db.from_numpy("fx", a, tile=(2, 2))
    (got,) = tq.grad(tq.einsum("ij,ij->", x, x * 2.0, join="t_fz_adj_ok"), [x])
    t = torch.tensor(a, requires_grad=True)
    (want,) = torch.autograd.grad((t * (2 * t) ** 2).sum(), [t])
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-12)


# -- found by the s9 fuzzing helper -----------------------------------------------------------

@pytest.mark.parametrize("devices", [10**6, 2**62, "null:99999999", [f"cpu:{i}" for i in
                                                                      range(16385)]])
def test_more_devices_than_a_plan_is_made_for_is_an_option_error(devices):
    """connect(devices=2**62) built a list of 2**62 names until the process was killed;
    optimize(devices=10**6) a MemoryError of the cost model's devices x devices matrix."""
    with pytest.raises(tq.OptionError, match="more than the 16384 devices"):
        tq.connect(devices=devices)


def test_optimize_for_more_devices_than_planned_for_is_a_plan_error(db, x):
    with pytest.raises(tq.PlanError, match="more than the 16384 devices"):
        tq.optimize(x * 2, devices=10**6)
    assert tq.optimize(x * 2, devices=16).devices == 16


@pytest.mark.parametrize("name", [["x"], {"x": 1}, {}])
def test_an_unhashable_name_is_an_unknown_tensor(name):
    """db.tensor(['x']) raised Python's TypeError (unhashable type) from the store's cache."""
    from tensorql.storage.memory_store import MemoryChunkStore

    for session in (tq.connect(), tq.connect(store=MemoryChunkStore())):
        session.from_numpy("x", np.ones(2))
        for call in (session.tensor, session.drop, session.iter_chunks):
            with pytest.raises(tq.UnknownTensorError):
                call(name)
        assert session.tensors() == ["x"]


def test_connect_takes_an_options_object_and_a_chunk_store_only(tmp_path):
    """connect(options="x") raised AttributeError ('str' has no 'backend'), and
    connect(store="x") an AttributeError when the session was closed."""
    with pytest.raises(tq.OptionError, match="takes a tq.Options, not str"):
        tq.connect(options="x")
    with pytest.raises(tq.StorageError, match="takes a ChunkStore, not str"):
        tq.connect(store="x")
    with tq.connect(options=tq.Options(workers=1)) as db:
        assert db.options.workers == 1


def test_grad_inputs_are_a_list_or_one_tensor(db, x):
    """tq.grad(loss, None) raised Python's TypeError; one Tensor was iterated row by row (a
    GradientError about rows the loss does not use); torch.autograd.grad takes one tensor."""
    loss = (x * x).sum()
    for inputs in (None, 3):
        with pytest.raises(tq.GradientError, match="inputs must be a list of tensors"):
            tq.grad(loss, inputs)
    (g,) = tq.grad(loss, x)
    np.testing.assert_array_equal(g.numpy(), 2 * np.arange(3, dtype=np.float32))


def test_interleaved_labels_past_any_character_are_renumbered(db, x):
    """An integer label of 10**9 was opt_einsum's chr() ValueError; as any label it names a
    dimension, so numbered with the others it gives numpy's answer."""
    w = np.arange(6.0).reshape(2, 3)
    np.testing.assert_allclose(tq.einsum(w, [10**9, 0], x, [0], [10**9]).numpy(),
                               w @ np.arange(3.0))


def test_big_endian_arrays_are_operands_like_any_other(db, x):
    """Found by fuzzing (s9): a '>f8' array as an einsum operand or constant raised torch's
    ValueError (byte order different from the native)."""
    big = np.arange(3, dtype=">f8")
    assert float(tq.einsum("i,i->", x, big).numpy()) == 5.0
    np.testing.assert_array_equal((db.constant(np.ones(3, ">f4")) + big).numpy(), [1, 2, 3])


@pytest.mark.parametrize("value, words", [
    (torch.ones(3, device="meta"), "meta device"), (torch.ones(3).to_sparse(), "sparse_coo"),
])
def test_a_meta_or_sparse_torch_constant_is_unsupported(db, value, words):
    """db.constant(meta tensor) raised torch's NotImplementedError (cannot copy out of meta)."""
    with pytest.raises(tq.UnsupportedError, match=words):
        db.constant(value)


@pytest.mark.parametrize("replacements", [None, [("x", 1.0)], "x"])
def test_substitute_takes_a_dict(db, x, replacements):
    """tq.substitute(e, None) raised AttributeError ('NoneType' has no attribute 'items')."""
    with pytest.raises(tq.UnsupportedError, match="must be a dict"):
        tq.substitute(x * 2, replacements)
    np.testing.assert_array_equal(tq.substitute(x * 2, {"x": x + 1}).numpy(), [2, 4, 6])


@pytest.mark.parametrize("view", [np.ones((1, 3))[::-1], np.ones((3, 1))[:, ::-1],
                                  np.arange(1.0)[::-1]])
def test_a_flipped_size_one_dimension_is_an_operand(db, x, view):
    """Found by fuzzing (s9): numpy calls a view flipped along a size-1 dimension
    C-contiguous, but its stride is negative and torch.from_numpy refused it (ValueError)."""
    np.testing.assert_array_equal(db.constant(view).numpy(), view)
    np.testing.assert_array_equal(tq.einsum("i,...->...i", x, view).numpy(),
                                  np.einsum("i,...->...i", np.arange(3.0), view))


def test_a_memory_limit_past_the_process_figure_leaves_results_room():
    """Found by fuzzing (s9): memory_limit="20GiB" (the contract's example) on a host whose
    process figure is smaller reserved it all for the CPU device, and a 24-byte result was a
    MemoryLimitError ("may hold 0 B more"); the budget keeps 1/16 of the figure, as the host
    tier does."""
    from tensorql.options import Options

    opts = Options(process_memory_limit="8GiB", devices="cpu", memory_limit="20GiB")
    assert opts.dense_result_budget(system=False) == (8 << 30) // 16
    for limit in ("20GiB", 2**70):
        with tq.connect(memory_limit=limit) as session:
            x = session.from_numpy("x", np.arange(3.0))
            np.testing.assert_array_equal((x * 2).numpy(), [0.0, 2.0, 4.0])


def test_a_memory_size_of_many_digits_is_read_as_the_most_there_is():
    """parse_bytes("9" * 400) went through float('inf') to an OverflowError; a size past a
    signed 64-bit count then reached numpy's int64 arithmetic of the partitioner (a raw
    OverflowError on two devices) and DuckDB (a raw ParserException)."""
    from tensorql.options import MAX_BYTES, parse_bytes

    assert parse_bytes("9" * 400) == parse_bytes(2**80) == MAX_BYTES == 2**63 - 1
    assert parse_bytes("1.5KiB") == 1536
    a = np.arange(30, dtype=np.float64).reshape(6, 5)
    with tq.connect(memory_limit=2**63, devices=2) as db:
        A = db.from_numpy("A", a, tile=(3, 2))
        np.testing.assert_allclose((A @ A.T).numpy(), a @ a.T)
        plan = tq.optimize(A @ A.T, devices=2, memory_limit=2**80, strategy="exhaustive")
        assert plan.cost.bytes_moved >= 0


@pytest.mark.parametrize("value", ["0", "0B", "0.4", "0.5b", 0, -1])
@pytest.mark.parametrize("option", ["memory_limit", "process_memory_limit",
                                    "store_memory_limit"])
def test_a_memory_size_of_no_bytes_is_refused_however_written(option, value):
    """ "0" or "0.4" (0 bytes) opened a session whose first query failed, where 0 was
    refused."""
    with pytest.raises(tq.OptionError, match="memory size must be positive"):
        tq.connect(**{option: value})


@pytest.mark.parametrize("dtype, build, scalar", [
    (np.int32, lambda t, s: t + s, 2**40),
    (np.int32, lambda t, s: t * s, 2**31),
    (np.int32, lambda t, s: s - t, -(2**31) - 1),
    (np.int8, lambda t, s: t + s, 300),
    (np.uint8, lambda t, s: t - s, -1),
])
def test_a_python_integer_out_of_an_integer_tensors_range_is_refused(db, dtype, build, scalar):
    """Found by fuzzing (s16): ``int32 + 2**40`` gave [0 1 2] -- the scalar was cast into the
    tensor's dtype and wrapped. numpy (NEP 50) and torch refuse such a scalar; so does
    tensorql now, where an in-range one keeps the tensor's dtype as numpy's does."""
    a = np.arange(3, dtype=dtype)
    t = db.from_numpy("t", a)
    with pytest.raises(OverflowError):
        build(a, scalar)
    with pytest.raises(tq.DTypeError, match=f"Python integer {scalar} is out of bounds"):
        build(t, scalar)
    inside = int(np.iinfo(dtype).max) - 2
    got = (t + inside).numpy()
    assert got.dtype == a.dtype
    np.testing.assert_array_equal(got, a + inside)


@pytest.mark.parametrize("option", ["memory_limit", "process_memory_limit",
                                    "store_memory_limit", "chunk_cache_bytes"])
def test_a_numpy_integer_is_a_byte_count_for_every_memory_option(option):
    """A size computed with numpy (``np.int64``) is a byte count wherever an int is; a numpy
    bool or float is still refused."""
    size = np.int64(64) << 20
    db = tq.connect(**{option: size})
    assert getattr(db.options, option) == 64 << 20
    assert type(getattr(db.options, option)) is int
    db.close()
    for bad in (np.float64(1e6), np.bool_(True)):
        with pytest.raises(tq.OptionError):
            tq.connect(**{option: bad})
