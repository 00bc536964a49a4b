"""The engine's tape strategy: a plan lowered once into bound calls over buffers gives, run
after run, the values of the serial strategy on the same plan (and of numpy/torch)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tensorql as tq
from tensorql.exec import engine, tape
from tensorql.exec.serial import SerialSchedule
from tensorql.exec.tape import Tape, run_tape
from tensorql.exec.taskgraph import ChunkRef, Task, TaskGraph
from tensorql.models import KVCache, Llama, LlamaShape


def _runs(graph, strategy):
    return engine.run(graph, engine.EngineConfig.cpu(), strategy=strategy).outputs


def test_decoder_tape_matches_the_serial_run_token_after_token():
    """A LLaMA decoder's plan, several tokens with the KV cache growing in place: the tape's
    outputs (logits and every layer's new keys/values) equal the serial strategy's on the
    same plan and inputs; the tape is lowered once and replayed."""
    shape = LlamaShape(vocab=37, d_model=16, d_ff=24, layers=2, heads=4, kv_heads=2,
                       head_dim=4)
    model = Llama.random(tq.connect(), shape, seed=3)
    _, cache = model.step([[5, 1, 7]], KVCache(()))
    decoder = model.decoder(cache, max_length=12)
    graph = decoder.query.physical.task_graph()
    tokens = np.random.default_rng(0).integers(0, shape.vocab, size=6).tolist()
    for n, token in enumerate(tokens):
        t = decoder._set_token([[token]])
        serial = decoder.query.run(strategy="serial")
        taped = decoder.query.run(strategy="tape")
        assert len(serial) == len(taped) == 1 + shape.layers
        for want, got in zip(serial, taped):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        lowered = Tape.of(graph)
        if n == 0:
            first = lowered
        assert lowered is first  # replayed, not lowered again, as the cache grows
        decoder._append(t, taped[1:])
    assert decoder.position == 3 + len(tokens)
    counts = first.counts
    assert counts.calls >= counts.bound + counts.generic and counts.sources > 0
    # and the decoder's own steps (tape) against fresh step() calls (independent plans)
    more = [[3]], [[11]], [[0]]
    for token in more:
        expected, cache2 = model.step(token, KVCache(tuple(b[:, :, :decoder.position].clone()
                                                           for b in decoder.caches)))
        np.testing.assert_allclose(decoder.step(token).numpy(), expected.numpy(), atol=1e-5)


class _Const:
    def __init__(self, value):
        self.value = value

    def storage_key(self):
        return self.value.data_ptr()

    def run(self, inputs, acc):
        return self.value


class _Fresh:
    """A source that computes a new tensor every run (no storage key)."""

    def __init__(self, value):
        self.value = value

    def run(self, inputs, acc):
        out = torch.full((3,), self.value)
        return out if acc is None else acc.add_(out)


class _Scale:
    def __init__(self, factor):
        self.factor = factor

    def run(self, inputs, acc):
        out = inputs[0] * self.factor
        return out if acc is None else acc.add_(out)


class _View:
    def run(self, inputs, acc):
        return inputs[0].view(3, 1)


def test_contributions_views_and_sources_replayed():
    x = torch.ones(3)
    a, b, c, d, e = (ChunkRef(n, ()) for n in range(5))
    graph = TaskGraph(tasks=(
        Task(0, (), a, _Const(x)),
        Task(1, (a,), b, _Scale(2.0)), Task(2, (a,), b, _Scale(3.0)),  # b = 5x
        Task(3, (b,), c, _View()),                                    # a view: no call
        Task(4, (), d, _Fresh(1.0)), Task(5, (), d, _Fresh(2.0)),     # d = 3, fresh each run
        Task(6, (c,), e, _Scale(1.0)),
    ), retain=frozenset({2, 3, 4}))
    first = _runs(graph, "tape")
    counts = Tape.of(graph).counts
    assert counts.views == 1 and counts.accumulate == 2 and counts.sources == 1
    x.copy_(torch.tensor([1.0, 2.0, 3.0]))  # written in place: replayed
    again = _runs(graph, "tape")
    assert Tape.of(graph).counts == counts
    want = _runs(graph, "serial")
    for ref in want:
        torch.testing.assert_close(again[ref], want[ref])
    assert again[c].flatten().tolist() == [5.0, 10.0, 15.0]
    assert again[d].tolist() == [3.0, 3.0, 3.0] and first[c].flatten().tolist() == [5.0] * 3
    # outputs are copies: the next run does not change what a caller holds
    x.fill_(0.0)
    _runs(graph, "tape")
    assert again[c].flatten().tolist() == [5.0, 10.0, 15.0]


def test_a_replaced_constant_lowers_the_tape_again():
    x = torch.ones(3)
    kernel = _Const(x)
    a, b = ChunkRef(0, ()), ChunkRef(1, ())
    graph = TaskGraph(tasks=(Task(0, (), a, kernel), Task(1, (a,), b, _Scale(2.0))),
                      retain=frozenset({1}))
    assert _runs(graph, "tape")[b].tolist() == [2.0] * 3
    before = Tape.of(graph)
    kernel.value = torch.full((3,), 4.0)  # another storage: the tape is stale
    assert _runs(graph, "tape")[b].tolist() == [8.0] * 3
    assert Tape.of(graph) is not before


def test_stored_tensors_tiled_products_against_numpy():
    """A query over stored tensors (store reads, a series over the contracted tiles, a
    pointwise chain) run as a tape, again after a constant changes in place."""
    rng = np.random.default_rng(7)
    db = tq.connect()
    a = rng.standard_normal((24, 40)).astype(np.float32)
    w = rng.standard_normal((40, 16)).astype(np.float32)
    stored = db.from_numpy("w", w, tile=(8, 16))
    x = torch.from_numpy(a.copy())
    expr = (tq.einsum("ij,jk->ik", db.constant(x), stored) + 1.0).relu()
    query = tq.pipeline.CompiledGroup.compile([expr.node], db)
    for scale in (1.0, -2.0, 0.5):
        x.copy_(torch.from_numpy(a * scale))
        (got,) = query.run(strategy="tape")
        want = np.maximum(a * scale @ w + 1.0, 0.0)
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-4)
    graph = query.physical.task_graph()
    assert Tape.of(graph).counts.sources >= 5  # the constant and the stored tiles
    before = Tape.of(graph)
    w2 = rng.standard_normal((40, 16)).astype(np.float32)
    db.from_numpy("w", w2, tile=(8, 16), replace=True)  # new chunks: lowered again
    (got,) = query.run(strategy="tape")
    np.testing.assert_allclose(got.numpy(), np.maximum(a * 0.5 @ w2 + 1.0, 0.0), rtol=1e-5,
                               atol=1e-4)
    assert Tape.of(graph) is not before


def test_graphs_beyond_the_byte_bound_run_serially(monkeypatch):
    db = tq.connect()
    x = torch.arange(12.0).reshape(3, 4)
    query = tq.pipeline.CompiledGroup.compile([(db.constant(x) * 2.0).node], db)
    monkeypatch.setattr(tape, "TAPE_MAX_BYTES", 8)
    (got,) = query.run(strategy="tape")
    assert torch.equal(got, x * 2.0)
    assert "tape" not in query.physical.task_graph().programs


def test_a_failing_call_names_its_task():
    class Boom:
        fail = False

        def run(self, inputs, acc):
            if Boom.fail:
                raise RuntimeError("boom")
            return inputs[0] + 1

    a, b = ChunkRef(0, ()), ChunkRef(1, ())
    graph = TaskGraph(tasks=(Task(0, (), a, _Const(torch.ones(2))), Task(1, (a,), b, Boom())),
                      retain=frozenset({1}))
    run_tape(graph)
    Boom.fail = True
    with pytest.raises(tq.TensorQLError, match="task 1.*boom"):
        run_tape(graph)


_CONTRACTIONS = [
    ((("b", "s", "d"), ("v", "d")), ("b", "s", "v"), [(1, 1, 8), (5, 8)]),       # flat, W^T
    ((("d", "f"), ("b", "s", "f")), ("b", "s", "d"), [(6, 8), (1, 1, 8)]),       # swapped
    ((("i", "j"), ("j", "k")), ("k", "i"), [(3, 4), (4, 5)]),                    # transposed
    ((("i", "j"), ("j", "k")), ("i", "k"), [(20, 4), (4, 5)]),                   # >= 16 rows
    ((("b", "s", "d"), ("b", "s", "d")), ("b", "s"), [(2, 3, 4), (2, 3, 4)]),    # row dot
    ((("b", "s", "k", "e"), ("b", "t", "k", "e")), ("b", "k", "s", "t"),
     [(1, 2, 3, 4), (1, 5, 3, 4)]),                                               # einsum
    ((("b", "d"), ("d",)), ("b", "d"), [(3, 4), (4,)]),                          # broadcast
    ((("p",), ("b", "s", "k", "g", "p")), ("b", "k", "g", "s"), [(2,), (1, 1, 3, 2, 2)]),
    ((("b", "s", "p", "k", "e"), ("p", "e", "f")), ("b", "s", "p", "k", "f"),
     [(1, 1, 2, 3, 4), (2, 4, 4)]),                                               # batched
    ((("b", "k", "g", "s", "t"), ("b", "t", "k", "e")), ("b", "s", "k", "g", "e"),
     [(1, 2, 3, 1, 5), (1, 5, 2, 4)]),                                            # strided
]


@pytest.mark.parametrize("in_labels, out_labels, shapes", _CONTRACTIONS)
def test_bound_contractions_equal_the_kernel_run(in_labels, out_labels, shapes):
    from tensorql.physical.kernels import ContractChunk

    gen = torch.Generator().manual_seed(len(shapes[0]) * 7 + len(out_labels))
    inputs = [torch.randn(shape, generator=gen) for shape in shapes]
    kernel = ContractChunk(in_labels=in_labels, out_labels=out_labels)
    out = kernel.run(inputs, None)
    (call,) = kernel.bind(inputs, out)
    for _ in range(2):
        for x in inputs:
            x.copy_(torch.randn(x.shape, generator=gen))
        call()
        torch.testing.assert_close(out, kernel.run(inputs, None), rtol=1e-6, atol=1e-6)


def test_a_contraction_whose_views_would_copy_is_left_to_the_kernel():
    from tensorql.physical.kernels import ContractChunk

    kernel = ContractChunk(in_labels=(("i", "j", "k"), ("k", "j")), out_labels=("i",))
    inputs = [torch.ones(2, 3, 4)[:, :, ::2], torch.ones(2, 3)]
    assert kernel.bind(inputs, kernel.run(inputs, None)) is None


# -- the policy's tape: a plan run again from its tape without being asked -----------------


def _chain(db, rng, sites=6, bond=8, phys=3, prefix="site"):
    """An MPS-like chain of stored tensors: its equation, numpy operands and stored ones."""
    arrays = [rng.standard_normal((phys, bond)).astype(np.float32)]
    terms = ["pa"]
    letters = iter("bcdefghijklmnoqrstuvwxyz")
    left = "a"
    for _ in range(sites - 2):
        right = next(letters)
        arrays.append(rng.standard_normal((phys, bond, bond)).astype(np.float32))
        terms.append("p" + left + right)
        left = right
    arrays.append(rng.standard_normal((phys, bond)).astype(np.float32))
    terms.append("p" + left)
    equation = ",".join(terms) + "->p"
    stored = [db.from_numpy(f"{prefix}{n}", a) for n, a in enumerate(arrays)]
    return equation, arrays, stored


def _strategy_of_runs(monkeypatch):
    chosen = []
    policy = engine.choose_strategy

    def record(graph, config):
        name = policy(graph, config)
        chosen.append(name)
        return name
    monkeypatch.setattr(engine, "choose_strategy", record)
    return chosen


def test_a_network_run_again_replays_its_tape(monkeypatch):
    """A tensor network's compiled query run again and again: the first run is serial, the
    second lowers the tape (the policy's choice: pure kernels, small buffers), the later
    ones replay it -- every result equal to opt_einsum's -- and a stored operand replaced
    makes the tape stale: lowered again, the result the new values'."""
    import opt_einsum

    rng = np.random.default_rng(11)
    db = tq.connect(workers=2)
    equation, arrays, stored = _chain(db, rng)
    chosen = _strategy_of_runs(monkeypatch)
    query = tq.einsum(equation, *stored).compile()
    graph = query.physical.task_graph()
    want = opt_einsum.contract(equation, *arrays)
    for _ in range(4):
        np.testing.assert_allclose(query.run(dense=True).dense().numpy(), want, rtol=1e-4,
                                   atol=1e-4)
    assert chosen == ["serial", "tape", "tape", "tape"]
    lowered = Tape.of(graph)
    assert lowered.counts.calls > 0 and graph.programs["tape-auto"]
    arrays[2] = rng.standard_normal(arrays[2].shape).astype(np.float32)
    db.from_numpy("site2", arrays[2], replace=True)
    np.testing.assert_allclose(query.run(dense=True).dense().numpy(),
                               opt_einsum.contract(equation, *arrays), rtol=1e-4, atol=1e-4)
    assert Tape.of(graph) is not lowered


def test_a_replayed_run_records_every_step_as_the_serial_run_does():
    """EXPLAIN ANALYZE and a run's figures of a plan replayed from its tape: every step with
    its tasks and bytes as the serial run counts them, and its time."""
    rng = np.random.default_rng(12)
    db = tq.connect(workers=2)
    equation, _, stored = _chain(db, rng)
    query = tq.einsum(equation, *stored).compile()
    graph = query.physical.task_graph()
    serial = query.run(dense=True).stats
    query.run(dense=True)  # lowers the tape
    replayed = query.run(dense=True).stats
    assert "tape" in graph.programs
    assert replayed.serial and replayed.tasks == serial.tasks
    assert sorted(replayed.steps) == sorted(serial.steps)
    for step, st in serial.steps.items():
        got = replayed.steps[step]
        assert (got.tasks, got.bytes_in, got.bytes_read) == (st.tasks, st.bytes_in,
                                                             st.bytes_read), step
        assert 0.0 <= got.first_start <= got.last_end <= replayed.wall_s
    assert sum(st.busy_s for st in replayed.steps.values()) > 0.0
    text = query.explain(analyze=True)
    assert "EXPLAIN ANALYZE" in text and "1 thread (serial)" in text


def test_runs_of_one_plan_on_two_threads_at_once_each_get_their_own_result():
    """A tape's buffers serve one run at a time: threads running the same plan together
    (one replays, the other runs serially meanwhile) each get the right values."""
    import threading

    import opt_einsum

    rng = np.random.default_rng(13)
    db = tq.connect(workers=2)
    equation, arrays, stored = _chain(db, rng, sites=8, bond=16)
    query = tq.einsum(equation, *stored).compile()
    want = opt_einsum.contract(equation, *arrays)
    query.run(dense=True), query.run(dense=True)  # serial, then the tape lowered
    errors = []

    def work():
        try:
            for _ in range(30):
                got = query.run(dense=True).dense().numpy()
                np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
        except AssertionError as err:
            errors.append(err)
    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_the_policy_leaves_impure_large_and_stale_graphs_serial(monkeypatch):
    a, b = ChunkRef(0, ()), ChunkRef(1, ())
    config = engine.EngineConfig.cpu()

    class Pure(_Scale):
        replayable = True

    class PureConst(_Const):
        replayable = True

    def graph_of(kernel, nbytes=12):
        return TaskGraph(tasks=(Task(0, (), a, PureConst(torch.ones(3))),
                                Task(1, (a,), b, kernel)),
                         retain=frozenset({1}), chunk_bytes={a: 12, b: nbytes})

    pure = graph_of(Pure(2.0))
    assert [engine.choose_strategy(pure, config) if engine.run(pure, config) else None
            for _ in range(3)][-1] == "tape"
    impure = graph_of(_Scale(2.0))  # not declared replayable (e.g. an optimizer's update)
    for _ in range(3):
        engine.run(impure, config)
    assert engine.choose_strategy(impure, config) == "serial" and "tape" not in impure.programs
    large = graph_of(Pure(2.0), nbytes=tape.AUTO_TAPE_MAX_BYTES + 1)
    for _ in range(3):
        engine.run(large, config)
    assert engine.choose_strategy(large, config) == "serial"
    # a source that hands back a new tensor every run makes each replay a new lowering:
    # after STALE_LIMIT of them the policy runs the graph serially again
    fresh = TaskGraph(tasks=(Task(0, (), a, _FreshPure(1.0)), Task(1, (a,), b, Pure(2.0))),
                      retain=frozenset({1}), chunk_bytes={a: 12, b: 12})
    chosen = _strategy_of_runs(monkeypatch)
    for _ in range(2 + tape.STALE_LIMIT + 2):
        assert engine.run(fresh, config).outputs[b].tolist() == [2.0] * 3
    assert chosen[:2] == ["serial", "tape"] and chosen[-2:] == ["serial", "serial"]


class _FreshPure(_Fresh):
    replayable = True


def test_the_policy_keeps_its_tapes_within_the_budget(monkeypatch):
    """Tapes the policy chose count against AUTO_TAPES_TOTAL_BYTES: the oldest is dropped
    (and lowered again if its plan runs again); a tape asked for by name is not counted."""
    monkeypatch.setattr(tape, "_AUTO_TAPES", type(tape._AUTO_TAPES)())
    rng = np.random.default_rng(14)
    db = tq.connect(workers=2)
    queries = []
    for n in range(3):
        equation, _, stored = _chain(db, rng, prefix=f"chain{n}_")  # tapes of one size
        queries.append(tq.einsum(equation, *stored).compile())
    sizes = []
    for q in queries[:2]:
        q.run(dense=True), q.run(dense=True)
        kept = Tape.of(q.physical.task_graph())
        sizes.append(kept.nbytes + kept.source_bytes)
    monkeypatch.setattr(tape, "AUTO_TAPES_TOTAL_BYTES", sum(sizes))
    last = queries[2]
    last.run(dense=True), last.run(dense=True)  # its tape pushes the oldest out
    graphs = [q.physical.task_graph() for q in queries]
    assert "tape" not in graphs[0].programs
    assert "tape" in graphs[1].programs and "tape" in graphs[2].programs
    queries[0].run(dense=True)  # run again: lowered again
    assert "tape" in graphs[0].programs


def test_a_stored_operand_dropped_after_the_tape_was_made_is_the_serial_runs_error():
    """A replay checks its store reads first: one that fails (the tensor dropped) sends the
    run to lowering, which fails as a serial run of the plan does -- a TensorQLError naming
    the tensor, not a raw exception from the check."""
    rng = np.random.default_rng(15)
    db = tq.connect(workers=2)
    equation, _, stored = _chain(db, rng, prefix="gone")
    query = tq.einsum(equation, *stored).compile()
    for _ in range(3):
        query.run(dense=True)
    assert "tape" in query.physical.task_graph().programs
    db.drop("gone1")
    with pytest.raises(tq.TensorQLError, match="gone1"):
        query.run(dense=True)


def test_a_result_handed_out_by_the_policys_tape_is_the_callers_to_keep():
    """The sink of a run the policy replayed gets a tensor of its own: a chunk a caller keeps
    (a streamed write still encoding it) is not overwritten by the plan's next run."""
    rng = np.random.default_rng(16)
    db = tq.connect(workers=2)
    equation, arrays, stored = _chain(db, rng, prefix="kept")
    first = torch.from_numpy(arrays[0].copy())
    query = tq.einsum(equation, db.constant(first), *stored[1:]).compile()
    graph = query.physical.task_graph()
    config = engine.EngineConfig.of(db.options)

    def run(sink=None):
        with query.physical.pinned():
            return engine.run(graph, config, sink=sink, keep_outputs=sink is None)
    run(), run()
    assert "tape" in graph.programs
    kept = []
    run(lambda ref, chunk: kept.append(chunk))
    before = [k.clone() for k in kept]
    first.mul_(2.0)  # written in place: the tape is current, its next run replays
    again = run()
    assert kept and all(torch.equal(k, b) for k, b in zip(kept, before))
    assert all(torch.allclose(v, 2.0 * b, rtol=1e-5, atol=1e-6)
               for v, b in zip(again.outputs.values(), before))


def test_a_run_with_a_progress_callback_reports_each_task_as_the_serial_run_does():
    """The policy's tape reports progress once, at its end: a run given a progress callback
    (a progress bar) runs serially, each task reported as it ends."""
    rng = np.random.default_rng(17)
    db = tq.connect(workers=2)
    equation, _, stored = _chain(db, rng, prefix="progress")
    query = tq.einsum(equation, *stored).compile()
    graph = query.physical.task_graph()
    query.run(dense=True), query.run(dense=True)
    assert "tape" in graph.programs
    seen = []
    query.run(progress=lambda done, total: seen.append((done, total)), dense=True)
    total = len(graph.tasks)
    assert seen[-1] == (total, total) and len(seen) >= total - len(SerialSchedule.of(graph).inline)


class _AddInPlace:
    """``inputs[0] + 1`` written over ``inputs[0]`` when its destination is that memory
    (an update computed in place), else into a new tensor."""

    calls = 0

    def run(self, inputs, acc):
        _AddInPlace.calls += 1
        return inputs[0] + 1.0

    def run_into(self, inputs, out):
        _AddInPlace.calls += 1
        return torch.add(inputs[0], 1.0, out=out)


def _in_place_graph(x):
    a, b = ChunkRef(0, ()), ChunkRef(1, ())
    return a, b, TaskGraph(tasks=(Task(0, (), a, _Const(x)), Task(1, (a,), b, _AddInPlace())),
                           retain=frozenset({1}))


def test_a_result_whose_destination_is_a_source_is_computed_there_each_run():
    x = torch.zeros(3)
    a, b, graph = _in_place_graph(x)

    def run(dest):
        return engine.run(graph, engine.EngineConfig.cpu(), strategy="tape",
                          destination=lambda ref: dest if ref == b else None)

    run(x)  # lowered: the update written over x, the tape's call bound to it
    tape_ = Tape.of(graph)
    assert [ref for ref, _ in tape_.destinations] == [b] and tape_.nbytes == 0
    for step in range(2, 5):  # replayed: each run adds one more, in x itself
        run(x)
        assert x.tolist() == [float(step)] * 3
    assert Tape.of(graph) is tape_
    # another destination: lowered again, the source left as it is
    other = torch.full((3,), -1.0)
    result = run(other)
    assert Tape.of(graph) is not tape_ and x.tolist() == [4.0] * 3
    assert result.outputs[b].tolist() == [5.0] * 3
    # and the memory of the source again: lowered again, in place once more
    run(x)
    assert x.tolist() == [5.0] * 3 and Tape.of(graph).destinations


def test_an_update_in_place_is_replayed_as_the_serial_run_computes_it():
    x, y = torch.zeros(4), torch.zeros(4)
    _, b, tape_graph = _in_place_graph(x)
    _, c, serial_graph = _in_place_graph(y)
    for _ in range(6):
        engine.run(tape_graph, engine.EngineConfig.cpu(), strategy="tape",
                   destination=lambda ref: x if ref == b else None)
        engine.run(serial_graph, engine.EngineConfig.cpu(), strategy="serial",
                   destination=lambda ref: y if ref == c else None)
        assert torch.equal(x, y)
    assert x.tolist() == [6.0] * 4
