"""One rank of the distributed tests (run by torchrun from tests/exec/test_distributed.py).

Every rank builds the same workloads from the same seeded arrays, runs them through
``tq.connect(distributed=True)`` and writes what it saw to ``<out>/rank<R>.json``.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

import tensorql as tq
from tensorql.models import attention, llama_block, mlp


def build(db, name):
    if name == "matmul":  # the optimizer splits w's columns: result chunks are column blocks
        import torch

        from tensorql.models.workloads import Workload

        rng = np.random.default_rng(5)
        arrays = {"mx": rng.standard_normal((6, 8)).astype(np.float32),
                  "mw": rng.standard_normal((8, 10)).astype(np.float32)}
        x, w = (db.from_numpy(k, v, replace=True) for k, v in arrays.items())
        return Workload("matmul", x @ w, arrays,
                        lambda: torch.from_numpy(arrays["mx"]) @ torch.from_numpy(arrays["mw"]))
    if name == "reduce":  # one row: the second product's sum is split, then reduce-scattered
        import torch

        from tensorql.models.workloads import Workload

        rng = np.random.default_rng(6)
        arrays = {"rx": rng.standard_normal((1, 96)).astype(np.float32),
                  "rw1": rng.standard_normal((96, 48)).astype(np.float32),
                  "rw2": rng.standard_normal((48, 12)).astype(np.float32)}
        x, w1, w2 = (db.from_numpy(k, v, replace=True) for k, v in arrays.items())
        t = {k: torch.from_numpy(v) for k, v in arrays.items()}
        return Workload("reduce", (x @ w1).relu() @ w2, arrays,
                        lambda: torch.relu(t["rx"] @ t["rw1"]) @ t["rw2"])
    if name == "mlp":
        return mlp(db, batch=10, d_model=12, d_ff=20)
    if name == "attention":
        return attention(db, batch=2, seq=6, d_model=12, heads=3, head_dim=4)
    return llama_block(db, batch=2, seq=6, d_model=12, heads=3, head_dim=4, d_ff=20)


def from_file(out: str, path: str) -> None:
    """Every rank opens the same DuckDB file read-only and reads only its own pieces."""
    import itertools

    from tensorql.physical.partitioned import LoadPiece
    from tensorql.storage.duckdb_store import DuckDBChunkStore

    rank = int(os.environ["RANK"])
    reads: list[list] = []
    original = DuckDBChunkStore._chunk_of  # every chunk decoded from DuckDB goes through it

    def counting(self, meta, table, key, result, cache=True):
        reads.append([meta.name, list(key)])
        return original(self, meta, table, key, result, cache)

    DuckDBChunkStore._chunk_of = counting
    with tq.connect(path, read_only=True, distributed=True, workers=1) as db:
        x, w = db.tensor("X"), db.tensor("W")
        query = (x @ w).relu().compile()
        value = query.run(dense=True).dense().numpy()
        mine = set(range(rank * 1, rank * 1 + 1))
        expected = []
        for step in query.physical.steps:
            for task in step.tasks:
                kernel = task.kernel
                if isinstance(kernel, LoadPiece) and task.device in mine:
                    spans = [range(lo // t, (hi - 1) // t + 1)
                             for lo, hi, t in zip(kernel.lo, kernel.hi, kernel.grid.tile)]
                    expected += [[kernel.name, list(k)] for k in itertools.product(*spans)]
    want = np.maximum(np.load(path + ".X.npy") @ np.load(path + ".W.npy"), 0)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"max_err": float(np.abs(value - want).max()), "reads": reads,
                   "expected": expected}, f)


def explain(out: str, name: str) -> None:
    """EXPLAIN ANALYZE on every rank, with the per-rank figures gathered after the run."""
    from dataclasses import asdict

    rank = int(os.environ["RANK"])
    with tq.connect(distributed=True, workers=1, distributed_timeout_s=60) as db:
        w = build(db, name)
        query = w.output.compile()
        text, run = query.explain_and_result(analyze=True)  # rank figures: analyze only
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump({"text": text, "ranks": [asdict(r) for r in run.stats.ranks],
                       "plan_bytes": int(query.partition.cost.bytes_moved),
                       "result_bytes": int(run.dense().nbytes)}, f)


def tensor_parallel(out: str, shape: str) -> None:
    """The MLP ``relu(x @ W1) @ W2`` of ``shape`` (``batch,d_model,d_ff``), its weights
    stored in K shards (W1 tiled by columns, W2 by rows, as a checkpoint for K-way tensor
    parallelism is), under a per-rank ``memory_limit`` of the Megatron plan's working set, the
    ``auto`` strategy: what each rank's chunk cache holds of the weights after the run
    (distinct storage) against the regions its own load tasks read."""
    import math

    from tensorql.physical.partitioned import LoadPiece

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    b, d, h = (int(n) for n in shape.split(","))
    limit = 4 * (b * d + math.ceil(d * h / world) + math.ceil(b * h / world))
    rng = np.random.default_rng(b * 10007 + d * 101 + h)
    x = rng.standard_normal((b, d)).astype(np.float32)
    w1 = (rng.standard_normal((d, h)) / np.sqrt(d)).astype(np.float32)
    w2 = (rng.standard_normal((h, d)) / np.sqrt(h)).astype(np.float32)
    cut = math.ceil(h / world)
    with tq.connect(distributed=True, workers=1, distributed_timeout_s=60,
                    memory_limit=limit) as db:
        tx = db.from_numpy("tp_x", x)
        t1 = db.from_numpy("tp_w1", w1, tile=(d, cut))
        t2 = db.from_numpy("tp_w2", w2, tile=(cut, d))
        query = ((tx @ t1).relu() @ t2).compile()
        got = query.run(dense=True).dense().numpy()
        store = db.chunk_store
        versions = store.pin(["tp_w1", "tp_w2"])
        tables = {v.handle for v in versions.values()}
        store.unpin(versions.values())
        held: dict[int, int] = {}
        for (table, _key), chunk in store.cache.items():
            if table in tables:
                storage = chunk.untyped_storage()
                held[storage.data_ptr()] = storage.nbytes()
        regions = {(task.kernel.name, tuple(task.kernel.lo), tuple(task.kernel.hi))
                   for step in query.physical.steps for task in step.tasks
                   if isinstance(task.kernel, LoadPiece) and task.device == rank
                   and task.kernel.name in ("tp_w1", "tp_w2")}
        result = {
            "max_err": float(np.abs(got - np.maximum(x @ w1, 0) @ w2).max()),
            "held": sum(held.values()),
            "read": sum(4 * math.prod(b - a for a, b in zip(lo, hi)) for _, lo, hi in regions),
            "weights": int(w1.nbytes + w2.nbytes),
            "pieces": [dict(zip(op.labels, op.pieces)) for op in query.partition.ops],
        }
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def store(out: str, path: str) -> None:
    """``db.store`` in a distributed job: every rank takes part in the run and stores the
    result in its own session's database -- rank 0 the file at ``path``, the others in
    memory. With TQ_TEST_DIE_RANK set that rank dies as the run starts."""
    rank = int(os.environ["RANK"])
    if rank == int(os.environ.get("TQ_TEST_DIE_RANK", "-1")):
        from tensorql.exec.distributed import DistributedRuntime

        DistributedRuntime.run = lambda *args, **kw: os._exit(3)
    outcome = {}
    with tq.connect(path if rank == 0 else None, distributed=True, workers=1,
                    distributed_timeout_s=15) as db:
        w = build(db, "mlp")
        try:
            db.store("y", w.output)
            outcome["stored"] = True
            outcome["max_err"] = float(np.abs(db.tensor("y").numpy() - w.reference()).max())
        except tq.TensorQLError as err:
            outcome["error"] = type(err).__name__
        outcome["exists"] = "y" in db.tensors()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(outcome, f)


def _count_wire_bytes() -> dict:
    """The bytes this rank hands torch.distributed for the plan's transfers, by call (the
    communication layer's count, apart from the runtime's own)."""
    import torch.distributed as dist

    wire: dict = {}
    send, isend, all_to_all = dist.send, dist.isend, dist.all_to_all_single

    def counted_send(tensor, *args, **kwargs):
        wire["send"] = wire.get("send", 0) + tensor.nbytes
        return send(tensor, *args, **kwargs)

    def counted_isend(tensor, *args, **kwargs):  # a transfer of its own: issued, then awaited
        wire["send"] = wire.get("send", 0) + tensor.nbytes
        return isend(tensor, *args, **kwargs)

    def counted_all_to_all(output, input, *args, **kwargs):
        wire["all_to_all"] = wire.get("all_to_all", 0) + input.nbytes  # own split empty
        wire["all_to_all_calls"] = wire.get("all_to_all_calls", 0) + 1
        return all_to_all(output, input, *args, **kwargs)

    batch = dist.batch_isend_irecv

    def counted_batch(ops):  # the result's all-gather: pairs issued together
        wire["results"] = wire.get("results", 0) + sum(
            op.tensor.nbytes for op in ops if op.op in (isend, counted_isend))
        wire["results_calls"] = wire.get("results_calls", 0) + 1
        for op in ops:  # torch's own isend, as batch_isend_irecv checks
            if op.op is counted_isend:
                op.op = isend
        return batch(ops)

    dist.send, dist.isend, dist.all_to_all_single = counted_send, counted_isend, \
        counted_all_to_all
    dist.batch_isend_irecv = counted_batch
    return wire


def _report_group_left_at_exit(out: str) -> None:
    """Write ``rank<R>.exit.json`` as the interpreter ends: whether the process group was
    still there after tensorql's exit handler (registered later, so run earlier) ran."""
    import atexit

    import torch.distributed as dist

    def report() -> None:
        with open(os.path.join(out, f"rank{os.environ['RANK']}.exit.json"), "w") as f:
            json.dump({"group_alive": dist.is_initialized()}, f)

    atexit.register(report)


def main() -> None:
    out, names = sys.argv[1], sys.argv[2]
    if os.environ["RANK"] == os.environ.get("TQ_TEST_ABSENT_RANK"):  # never joins the job
        os._exit(5)
    _report_group_left_at_exit(out)
    if names.startswith("file:"):
        return from_file(out, names[len("file:"):])
    if names.startswith("store:"):
        return store(out, names[len("store:"):])
    if names.startswith("tp:"):
        return tensor_parallel(out, names[len("tp:"):])
    if names.startswith("explain:"):
        return explain(out, names[len("explain:"):])
    names = names.split(",")
    rank = int(os.environ["RANK"])
    dies = int(os.environ.get("TQ_TEST_DIE_RANK", "-1"))
    if rank == dies:  # dies as its part of the run starts: the others must not hang
        from tensorql.exec.distributed import DistributedRuntime

        DistributedRuntime.run = lambda *args, **kw: os._exit(3)
    if rank == int(os.environ.get("TQ_TEST_STALL_RANK", "-1")):  # alive, but never answers
        import time

        from tensorql.exec.distributed import DistributedRuntime

        def stall(*args, **kw):
            time.sleep(float(os.environ.get("TQ_TEST_STALL_S", "30")))
            os._exit(4)

        DistributedRuntime.run = stall
    if os.environ.get("TQ_TEST_HOSTS_PER_NODE"):  # ranks of "nodes" of this many on this host
        import socket

        per = int(os.environ["TQ_TEST_HOSTS_PER_NODE"])
        socket.gethostname = lambda: f"node{rank // per}"
    results = {}
    wire = _count_wire_bytes()
    exchange = os.environ.get("TQ_TEST_EXCHANGE", "collective")
    devices = os.environ.get("TQ_TEST_DEVICES", "cpu").replace(
        "{local_rank}", os.environ.get("LOCAL_RANK", "0"))
    limit = os.environ.get("TQ_TEST_MEMORY_LIMIT")
    timeout = float(os.environ.get("TQ_TEST_TIMEOUT_S", "20"))
    with tq.connect(distributed=True, workers=1, distributed_timeout_s=timeout, devices=devices,
                    distributed_exchange=exchange,
                    memory_limit=int(limit) if limit else None) as db:
        for name in names:
            try:
                w = build(db, name)
                query = w.output.compile()
                run = query.run(dense=True)
            except tq.TensorQLError as err:
                results[name] = {"error": type(err).__name__, "message": str(err)}
                continue
            w = build(db, name)
            query = w.output.compile()
            wire.clear()
            run = query.run(dense=True)
            results[name] = {
                "wire": dict(wire),
                "result_bytes": int(run.dense().nbytes),
                "column_blocks": (lambda rel: rel.grid.tile[-1] < rel.shape[-1])(
                    query.physical.result_step.relation),
                "max_err": float(np.abs(run.dense().numpy() - w.reference()).max()),
                "moved": run.stats.moved,
                "predicted": (query.partition.pair_bytes().tolist() if query.partition
                              else [[0]]),
                "devices": query.partition.devices if query.partition else 1,
                "topology": (query.partition.topology.groups
                             if query.partition and query.partition.topology else None),
                "levels": (dict(query.partition.estimate.level_bytes)
                           if query.partition else None),
                "scattered": bool(query.partition and any(
                    op.scatter is not None for op in query.partition.ops)),
                "fused": sorted({s.name.split(" ")[0] for s in query.physical.steps
                                 if s.name.startswith(("Pointwise", "Attention"))}),
            }
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
