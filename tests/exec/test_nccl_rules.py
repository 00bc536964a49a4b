"""The distributed exchange under NCCL's pairing rules, on the CPU: two gloo ranks whose
point-to-point calls pair by issue order, tags ignored (``tests/exec/nccl_rules.py``), run
partitioned plans with exchanges as collectives and as point-to-point transfers. A rank that
issues its transfers in another order than its peer (concurrent threads, each tagged with its
op's id) gets the wrong chunks or waits until the timeout; here each pair's sequences must
mirror each other and the results match numpy and torch.

Also: the order every rank issues its transfers in (:func:`p2p_order`), and how a rank of a
job picks its devices on a machine with fewer GPUs than local ranks (a fake ``cuda_api``
reporting one GPU)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tensorql.cuda_api as cuda_api
from tensorql.errors import DistributedError
from tensorql.exec.distributed import communication_device, p2p_order
from tensorql.exec.exchanges import Exchange, plan_exchanges
from tensorql.exec.memplan import Op
from tensorql.exec.taskgraph import ChunkRef
from tensorql.options import Options

WORKER = Path(__file__).with_name("nccl_rules.py")
ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_two_ranks(tmp_path: Path, exchange: str) -> list[dict]:
    port = _free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                   OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, str(WORKER), str(tmp_path), exchange],
                                      env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    for proc in procs:
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr[-3000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def test_two_ranks_pair_their_transfers_by_issue_order(tmp_path):
    """Both exchange modes, and point-to-point transfers under a memory limit (a receive
    waits for an earlier chunk to be freed), in one job of two processes."""
    modes = ("p2p", "collective", "p2p@2048", "collective@2048")
    ranks = _run_two_ranks(tmp_path, ",".join(modes))
    flip = {"send": "recv", "recv": "send"}
    for exchange in modes:
        for seen in ranks:
            seen = seen[exchange]
            assert "error" not in seen, (exchange, seen["error"])
            assert seen["mlp_err"] < 1e-3 and seen["block_err"] < 1e-4
        mine, theirs = ranks[0][exchange]["issued"]["1"], ranks[1][exchange]["issued"]["0"]
        # the k-th call of rank 0 with rank 1 is the k-th of rank 1 with rank 0, reversed
        assert [[flip[d], shape, dtype, tag] for d, shape, dtype, tag in mine] == theirs
        sends = sum(1 for call in mine if call[0] == "send")
        assert sends and len(mine) - sends  # chunks cross both ways
        if exchange.startswith("p2p"):  # the plans' transfers, beyond the results' gathers
            assert len(mine) > 8, mine


def _op(i: int, kind: str, src: int, dst: int, deps=()) -> Op:
    return Op(i, kind, dst, ChunkRef(i % 3, (i,)), tuple(deps), 8, "d2d", src_device=src)


def test_the_p2p_order_is_the_plans_order_without_exchanges():
    ops = [_op(0, "send", 0, 1), _op(1, "send", 1, 0), _op(2, "compute", 1, 1, (0,)),
           _op(3, "send", 1, 0, (2,)), _op(4, "send", 0, 0)]  # op 4 stays on rank 0
    assert p2p_order(ops, (), rank_of=lambda d: d) == (0, 1, 3)


def test_a_transfer_waiting_on_an_exchange_comes_after_what_the_exchange_waits_on():
    # op 3 waits (via ops 1, 2) for the exchange of ops 0 and 6, and op 6 for op 5: issuing by
    # op id (3 before 5) would hold 5 back behind 3, which waits on 5 -- a deadlock
    ops = [_op(0, "send", 0, 1), _op(1, "compute", 1, 1, (0,)), _op(2, "compute", 1, 1, (1,)),
           _op(3, "send", 1, 0, (2,)), _op(4, "send", 0, 1), _op(5, "send", 1, 0, (4,)),
           _op(6, "send", 1, 0, (5,))]
    order = p2p_order(ops, (Exchange(0, 0, (0, 6)),), rank_of=lambda d: d)
    assert order == (4, 5, 3)


@pytest.mark.parametrize("budget", [None, 4096])
@pytest.mark.parametrize("exchange", ["p2p", "collective"])
def test_the_p2p_order_of_a_llama_block_on_four_ranks(budget, exchange):
    """Every cross-rank transfer outside the exchanges is in the order once, after every
    transfer it waits on, with or without a memory limit (rounds of one chunk)."""
    import tensorql as tq
    from tensorql.exec.memplan import plan_program
    from tensorql.models import llama_block

    with tq.connect(devices=4, workers=1) as db:
        block = llama_block(db, batch=2, seq=6, d_model=12, heads=3, head_dim=4, d_ff=20)
        graph = block.output.compile().physical.task_graph()
    program = plan_program(graph, 4, [budget] * 4, host_domains=[0, 1, 2, 3])
    ops = program.ops
    exchanges = () if exchange == "p2p" else \
        plan_exchanges(ops, int, one_chunk_each=budget is not None)
    exchanged = {i for ex in exchanges for i in ex.ops}
    order = p2p_order(ops, exchanges, int)
    assert sorted(order) == [op.id for op in ops if op.kind == "send" and
                             op.src_device != op.device and op.id not in exchanged]
    assert order or exchange == "collective"
    position = {i: k for k, i in enumerate(order)}
    ancestors: list[set[int]] = []
    for op in ops:
        ancestors.append(set().union(*(ancestors[d] | {d} for d in op.deps)))
    for i in order:
        assert all(position[a] < position[i] for a in ancestors[i] if a in position)


class OneGPU(cuda_api.TorchCuda):
    """A machine with one GPU (nothing runs on it: only device choice is asked)."""

    name = "fake cuda (one GPU)"

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def torch_device(self, index: int) -> torch.device:
        return torch.device("meta")


def _rank(monkeypatch, local_rank: int, local_world: int) -> None:
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world))


def test_two_local_ranks_on_one_gpu_run_on_the_cpu(monkeypatch, caplog):
    """The H100 failure: torchrun's two ranks on a one-GPU machine both took cuda:0 and NCCL
    refused ("invalid usage"). "auto" now gives each rank the CPU (gloo), and says why."""
    _rank(monkeypatch, 1, 2)
    with cuda_api.use(OneGPU()), caplog.at_level(logging.WARNING, logger="tensorql"):
        import tensorql.devices as devices

        devices._WARNED.clear()
        options = Options(distributed=True)
        assert options.device_set.names == ("cpu:0",)
        assert communication_device(options.device_set) == torch.device("cpu")
        assert Options().device_set.names == ("cuda:0",)  # not a rank: the machine's GPU
    assert "2 ranks on this machine but 1 GPU(s)" in caplog.text


def test_asking_for_cuda_with_too_few_gpus_fails_before_nccl(monkeypatch):
    _rank(monkeypatch, 0, 2)
    with cuda_api.use(OneGPU()), pytest.raises(DistributedError, match="NCCL cannot run two"):
        Options(distributed=True, devices="cuda")


def test_each_rank_with_a_gpu_takes_its_own(monkeypatch):
    class FourGPUs(OneGPU):
        def device_count(self) -> int:
            return 4

    with cuda_api.use(FourGPUs()):
        for local_rank in range(4):
            _rank(monkeypatch, local_rank, 4)
            names = Options(distributed=True).device_set.names
            assert names == (f"cuda:{local_rank}",)
            assert Options(distributed=True, devices="cuda").device_set.names == names
        _rank(monkeypatch, 1, 2)  # two ranks share the four: two each
        assert Options(distributed=True).device_set.names == ("cuda:2", "cuda:3")


def test_the_group_of_a_rank_on_the_cpu_never_uses_nccl(monkeypatch):
    """A rank whose devices are the CPU joins with gloo alone; one on a GPU sets it current
    (NCCL's device) and joins with NCCL for GPU tensors."""
    import tensorql.exec.distributed as distributed
    from tensorql.devices import DeviceSet

    joined, current = [], []

    class Recording(OneGPU):
        def set_device(self, device: torch.device) -> None:
            current.append(device)

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.distributed, "init_process_group",
                        lambda backend, **kw: joined.append(backend))
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 0)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 1)
    monkeypatch.setattr(distributed.atexit, "register", lambda fn: None)
    with cuda_api.use(Recording()):
        distributed.join_process_group(1, 5.0, DeviceSet.parse("cpu"))
        distributed.join_process_group(1, 5.0, DeviceSet.parse("cuda:0"))
    assert joined == ["gloo", "cpu:gloo,cuda:nccl"]
    assert current == [torch.device("meta")]


def test_ranks_of_one_machine_started_apart_may_not_share_a_gpu(monkeypatch):
    """Two launchers on one host (``--nnodes 2`` on one machine): each rank sees
    LOCAL_WORLD_SIZE 1 and takes GPU 0; joining says so before NCCL is touched."""
    import tensorql.exec.distributed as distributed
    from tensorql.devices import DeviceSet
    from tensorql.exec.distributed import RankLayout

    group = type("Group", (), {})()  # a stand-in the module can refer to weakly, as to torch's
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed.distributed_c10d, "_get_default_group", lambda: group)

    def all_gather_object(out, mine, group=None):
        out[:] = [mine, mine]  # the other rank: the same host, the same GPU

    monkeypatch.setattr(torch.distributed, "all_gather_object", all_gather_object)
    monkeypatch.setattr(distributed, "_GPUS_CHECKED", [])
    with pytest.raises(DistributedError, match="ranks 0 and 1 both use GPU 0 of host"):
        distributed.check_gpus_not_shared(RankLayout(1, 2), DeviceSet.parse("cuda:0"))
    distributed.check_gpus_not_shared(RankLayout(1, 2), DeviceSet.parse("cpu"))  # no GPU
