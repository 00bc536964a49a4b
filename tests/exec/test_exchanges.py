"""Grouping a memory plan's cross-rank transfers into exchanges (one all_to_all_single each):
which transfers may travel together, and the order every rank issues them in."""

from __future__ import annotations

from tensorql.exec.exchanges import plan_exchanges
from tensorql.exec.memplan import Op
from tensorql.exec.taskgraph import ChunkRef


def _send(op_id: int, step: int, src: int, dst: int, deps=()) -> Op:
    return Op(op_id, "send", dst, ChunkRef(step, (op_id,)), tuple(deps), 64, "d2d",
              src_device=src)


def _compute(op_id: int, device: int, deps) -> Op:
    return Op(op_id, "compute", device, ChunkRef(99, (op_id,)), tuple(deps), 0, "compute")


def _by_device(device: int) -> int:
    return device


def test_a_step_sent_from_several_ranks_is_one_exchange():
    ops = [_send(0, 5, 0, 1), _send(1, 5, 1, 0), _send(2, 5, 2, 0), _send(3, 5, 0, 2),
           _send(4, 6, 0, 1), _send(5, 6, 0, 2)]  # step 6: one sender, stays point-to-point
    (exchange,) = plan_exchanges(ops, _by_device)
    assert exchange.step == 5 and exchange.ops == (0, 1, 2, 3) and exchange.index == 0


def test_transfers_within_one_rank_are_not_exchanged():
    ops = [_send(0, 5, 0, 1), _send(1, 5, 1, 0)]
    assert plan_exchanges(ops, lambda device: 0) == ()  # devices 0 and 1 on one rank


def test_a_transfer_waiting_on_another_of_its_step_stays_point_to_point():
    # under a memory limit a receive may wait for an earlier one's chunk to be freed: one
    # collective carrying both would wait for itself
    ops = [_send(0, 5, 0, 1), _compute(1, 1, [0]), _send(2, 5, 1, 0, [1])]
    assert plan_exchanges(ops, _by_device) == ()


def test_a_pair_sending_twice_sends_in_rounds():
    # under a memory limit rank 0's second chunk for rank 1 may wait until rank 1 has used
    # (and freed) the first: each round is its own collective, the second after the first
    ops = [_send(0, 5, 0, 1), _send(1, 5, 1, 0), _compute(2, 1, [0]),
           _send(3, 5, 0, 1, [2])]
    exchanges = plan_exchanges(ops, _by_device)
    assert [ex.ops for ex in exchanges] == [(0, 1), (3,)]
    assert [ex.index for ex in exchanges] == [0, 1]


def test_under_a_memory_limit_a_rank_sends_and_receives_one_chunk_a_round():
    ops = [_send(0, 5, 0, 1), _send(1, 5, 0, 2), _send(2, 5, 1, 0), _send(3, 5, 2, 0),
           _send(4, 5, 1, 2)]
    plain = plan_exchanges(ops, _by_device)
    assert [ex.ops for ex in plain] == [(0, 1, 2, 3, 4)]
    rounds = [ex.ops for ex in plan_exchanges(ops, _by_device, one_chunk_each=True)]
    assert rounds == [(0, 2), (1, 3), (4,)]
    for ex_ops in rounds:
        assert len({ops[i].src_device for i in ex_ops}) == len(ex_ops)
        assert len({ops[i].device for i in ex_ops}) == len(ex_ops)


def test_an_exchange_waiting_on_another_is_issued_after_it():
    ops = [_send(0, 7, 0, 1),           # step 7, first op id: first by the tie-break
           _send(1, 8, 1, 0),           # step 8
           _send(2, 8, 0, 1),
           _compute(3, 0, [1]),         # reads step 8's chunk
           _send(4, 7, 0, 2, [3])]      # ... and is sent in step 7
    ops.append(_send(5, 7, 2, 0))
    order = [ex.step for ex in plan_exchanges(ops, _by_device)]
    assert order == [8, 7]


def test_exchanges_waiting_on_each_other_stay_point_to_point():
    ops = [_send(0, 7, 0, 1),           # a1
           _send(1, 8, 0, 1),           # b1
           _compute(2, 1, [1]),         # reads b1
           _compute(3, 1, [0]),         # reads a1
           _send(4, 7, 1, 0, [2]),      # a2 waits on b1: step 7 after step 8
           _send(5, 8, 1, 0, [3])]      # b2 waits on a1: step 8 after step 7
    assert plan_exchanges(ops, _by_device) == ()


def test_steps_that_do_not_wait_on_each_other_travel_together():
    # steps 5 and 6 are independent: one collective; step 7 reads step 5's chunk first
    ops = [_send(0, 5, 0, 1), _send(1, 5, 1, 0), _send(2, 6, 0, 1), _send(3, 6, 1, 0),
           _compute(4, 1, [0]), _send(5, 7, 1, 0, [4]), _send(6, 7, 0, 1)]
    exchanges = plan_exchanges(ops, _by_device)
    assert [(ex.steps, ex.ops) for ex in exchanges] == [((5, 6), (0, 1, 2, 3)),
                                                        ((7,), (5, 6))]
    assert exchanges[0].step == 5
    # chunks of another dtype travel apart; under a memory limit every round is its own
    dtypes = {5: "float32", 6: "float64", 7: "float32"}
    apart = plan_exchanges(ops, _by_device, dtype_of=lambda op: dtypes[op.ref.step])
    assert [ex.steps for ex in apart] == [(5,), (6,), (7,)]
    budgeted = plan_exchanges(ops, _by_device, one_chunk_each=True)
    assert all(len(ex.steps) == 1 for ex in budgeted)


def test_a_llama_block_on_four_devices_repartitions_in_two_exchanges():
    """Each device sends each other one slice a repartition; the query, key and value
    repartitions (computed side by side) travel as one collective, the attention output's
    (computed from them) as another."""
    import tensorql as tq
    from tensorql.exec.runtime import Runtime
    from tensorql.models import llama_block
    from tensorql.optimizer import optimize
    from tensorql.physical.partitioned import build_partitioned

    with tq.connect(workers=1) as db:
        block = llama_block(db, batch=1, seq=16, d_model=32, heads=4, head_dim=8, d_ff=48)
        logical = block.output.compile().physical.root
        plan = optimize(logical, devices=4, sources_everywhere=True)
        graph = build_partitioned(plan, db.chunk_store, sub_tiles=False).task_graph()
    program = Runtime(4).plan(graph)
    exchanges = plan_exchanges(program.ops, _by_device)
    sends = [op for op in program.ops if op.kind == "send"]
    assert exchanges and sends
    carried = [i for ex in exchanges for i in ex.ops]
    assert len(carried) == len(set(carried))
    assert [len(ex.steps) for ex in exchanges] == [3, 1]
    for ex in exchanges:
        assert {program.ops[i].ref.step for i in ex.ops} == set(ex.steps)
    # the block's repartitions come from every device
    for ex in exchanges:
        assert {program.ops[i].src_device for i in ex.ops} == {0, 1, 2, 3}
