"""tensorql on torch.distributed against PyTorch DTensor with Megatron sharding, same run.

    python bench/distributed.py [--ranks 1,2,4] [--repeat 3] [--issue-size | --tiny]
                                [--workloads mlp,block,mlp-dp,mlp-tp]

For each rank count K the bench launches K local processes (gloo, one torch thread each,
``MASTER_ADDR``/``RANK``/``WORLD_SIZE`` as torchrun sets them). Every rank builds the same
seeded inputs and times both contenders in turn (one run of each, then again; medians):

* **tensorql**: ``tq.connect(distributed=True)``; the optimizer partitions the query over the
  K ranks' devices and each rank runs its tasks; the dense result ends on every rank (its
  chunks all-gathered), as DTensor's replicated output does;
* **DTensor**: the same model as ``torch.nn`` modules, ``parallelize_module`` with
  ``ColwiseParallel`` for the first projections (W1, W3, q, k, v) and ``RowwiseParallel`` for
  the second (W2, o): Megatron tensor parallelism, one all-reduce per MLP / attention.

Workloads: an MLP ``relu(x @ W1) @ W2`` and a LLaMA block (RMSNorm, rotary attention with a
causal mask, SwiGLU), the block of ``tensorql.models.llama_block``; both systems' results are
checked against the single-process reference.

Bytes communicated: tensorql's are measured -- the sizes of the tensors its ranks pass to
torch.distributed in one run (transfers between ranks and the all-gather of the result),
summed over ranks. DTensor's are its collectives as ``CommDebugMode`` counts them,
each all-reduce of S bytes priced at the ring algorithm's 2 (K-1) S bytes sent over all ranks.
Method (``bench/harness.py`` rules): with ``--isolate`` (the default) each contender runs in a
process group of its own -- K processes for tensorql, then K for DTensor (or the reverse: the
order of the two launches is seeded-random per row) -- and the DTensor processes never import
tensorql (they read the weights and the reference from a file the bench writes first). Each
launch makes one untimed call (kept as the cold figure, weight packing and planning on it) and
``--repeat`` timed ones, each between two barriers; medians and IQRs are printed. A third
launch a row (``--nopack``, the default with ``--isolate``) times tensorql with
``TENSORQL_PACKED_WEIGHTS=0``: the ``tq nopack`` column, tensorql without the packed copies it
reuses from its first call on (DTensor repacks per call).
``--no-isolate`` runs both in the same processes, alternating (the old way). One torch thread
per rank on both sides. Each rank's peak RSS (the largest over ranks) and DTensor's local
weight bytes per rank are reported.

A third workload, ``mlp-dp``, compares data parallelism: tensorql with ``strategy="data"``
against torch data parallelism (every rank holds all the weights and computes its rows of the
batch, the output all-gathered); its "DTensor" columns are that torch baseline.

A fourth, ``mlp-tp``, is tensor parallelism where it is needed: tensorql's ``auto`` strategy
under a per-rank ``memory_limit`` (``tp_memory_limit``: the largest working set of the Megatron
plan, below the bytes of both weights, so no rank may hold the weights whole) against the same
DTensor Megatron plan as ``mlp``, on the ``mlp``'s weights with a batch of d_model / 8 rows
(activations small beside the weights, where tensor parallelism is what fits: the row checks
that the limit is below ``replicated_floor``, the working set of any plan replicating the
weights; at the ``mlp``'s batch a 2 x 2 plan over 4 ranks fits it as well and moves fewer
bytes). Its weights are stored in shards, ``W1`` tiled by columns and
``W2`` by rows in K pieces, as a checkpoint meant for K-way tensor parallelism is; stored as one
chunk each, every rank would decode the whole chunk into its chunk cache to read its half (the
``memory_limit`` bounds the run's memory plan, not the chunk cache). The row checks that
tensorql's decoded weights per rank are at most 1/K of them (no replication).

Weight memory per rank (every row, the largest over ranks): tensorql's is the weight chunks and
regions its chunk cache holds after the timed runs (distinct storage), its packed copies
(``kernels/packed_weights.py``) beside them; DTensor's its local shards' bytes, torch DP's all
its parameters.

Rows with more ranks than cores are **correctness rows** only (oversubscribed: their times are
printed but gate nothing). Correctness (every row): both results within 1e-3 of the
single-process reference. Goals (the largest K <= cores above 1; not with ``--tiny``):
tensorql wall time <= 1.0x DTensor's, bytes <= DTensor's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
from harness import Record, Timing, add_arguments, ratio_text
from tables import cell

SIZES = {  # mlp-tp: the mlp's weights, a batch of d_model / 8 rows (see tp_memory_limit)
    "tiny": {"mlp": (16, 32, 64), "mlp-tp": (4, 32, 64), "block": (1, 16, 32, 4, 8, 48)},
    "default": {"mlp": (1024, 2048, 2048), "mlp-tp": (256, 2048, 2048),
                "block": (1, 256, 1024, 8, 128, 2816)},
    "issue": {"mlp": (2048, 4096, 4096), "mlp-tp": (512, 4096, 4096),
              "block": (1, 512, 2048, 16, 128, 5632)},
}


WORKLOADS = ("mlp", "block", "mlp-dp", "mlp-tp")
STRATEGY_ENV = "TQ_BENCH_STRATEGY"  # --tq-strategy, handed to the ranks


def mlp_shape(name: str, size: str) -> tuple[int, int, int]:
    """(batch, d_model, d_ff) of an MLP row: ``mlp-tp``'s own, the others' ``mlp``.

    >>> mlp_shape("mlp-tp", "default"), mlp_shape("mlp-dp", "default")
    ((256, 2048, 2048), (1024, 2048, 2048))
    """
    return SIZES[size]["mlp-tp" if name == "mlp-tp" else "mlp"]


# -- one rank ----------------------------------------------------------------------------------
def _megatron_mlp(arrays: dict, prefix: str):
    from torch import nn

    w1, w2 = arrays[prefix + "w1"], arrays[prefix + "w2"]
    model = nn.Sequential(nn.Linear(w1.shape[0], w1.shape[1], bias=False), nn.ReLU(),
                          nn.Linear(w2.shape[0], w2.shape[1], bias=False))
    with torch.no_grad():
        model[0].weight.copy_(torch.from_numpy(w1.T))
        model[2].weight.copy_(torch.from_numpy(w2.T))
    plan = {"0": "colwise", "2": "rowwise"}
    return model, plan, torch.from_numpy(arrays[prefix + "x"])


class _Block(torch.nn.Module):
    """The LLaMA block of ``tensorql.models.llama_block`` as torch modules (weights copied),
    with attention written over *local* heads so that column-sharded q/k/v work."""

    def __init__(self, a: dict, p: str, head_dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        from torch import nn

        d = a[p + "x"].shape[-1]
        heads = a[p + "l0_wq"].shape[1]

        def linear(w: np.ndarray) -> nn.Linear:
            layer = nn.Linear(w.shape[0], w.shape[1], bias=False)
            with torch.no_grad():
                layer.weight.copy_(torch.from_numpy(np.ascontiguousarray(w.T)))
            return layer

        self.q = linear(a[p + "l0_wq"].reshape(d, heads * head_dim))
        self.k = linear(a[p + "l0_wk"].reshape(d, heads * head_dim))
        self.v = linear(a[p + "l0_wv"].reshape(d, heads * head_dim))
        self.o = linear(a[p + "l0_wo"].reshape(heads * head_dim, d))
        self.w1, self.w3, self.w2 = (linear(a[p + "l0_w1"]), linear(a[p + "l0_w3"]),
                                     linear(a[p + "l0_w2"]))
        self.g1 = torch.from_numpy(a[p + "l0_attn_norm"])
        self.g2 = torch.from_numpy(a[p + "l0_mlp_norm"])
        self.cos, self.sin = (torch.from_numpy(a[p + "rope_cos"]),
                              torch.from_numpy(a[p + "rope_sin"]))
        self.rot, self.mask = (torch.from_numpy(a[p + "rope_rot"]),
                               torch.from_numpy(a[p + "mask"]))
        self.head_dim, self.eps = head_dim, eps

    def _norm(self, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * g

    def _rope(self, t: torch.Tensor) -> torch.Tensor:
        return t * self.cos[None, :, None, :] + (t @ self.rot) * self.sin[None, :, None, :]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        xn = self._norm(x, self.g1)
        q, k, v = (proj(xn).view(b, s, -1, self.head_dim) for proj in (self.q, self.k, self.v))
        q, k = self._rope(q), self._rope(k)
        scores = torch.einsum("bshe,bthe->bhst", q, k) / math.sqrt(self.head_dim) + self.mask
        o = torch.einsum("bhst,bthe->bshe", scores.softmax(-1), v).reshape(b, s, -1)
        h = x + self.o(o)
        hn = self._norm(h, self.g2)
        return h + self.w2(torch.nn.functional.silu(self.w1(hn)) * self.w3(hn))


def _dtensor_model(name: str, arrays: dict, prefix: str, head_dim: int, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    if name == "mlp":
        model, plan, x = _megatron_mlp(arrays, prefix)
    else:
        model = _Block(arrays, prefix, head_dim)
        plan = {"q": "colwise", "k": "colwise", "v": "colwise", "o": "rowwise",
                "w1": "colwise", "w3": "colwise", "w2": "rowwise"}
        x = torch.from_numpy(arrays[prefix + "x"])
    mesh = init_device_mesh("cpu", (world,))
    model = parallelize_module(model, mesh, {k: styles[v]() for k, v in plan.items()})
    return model, x


def _alternating(fns, repeat: int) -> list[tuple[list[float], float]]:
    """(samples, first) of each of ``fns`` across the ranks, run in turn (A, B, A, B, ...)
    so that a host whose speed drifts weighs on both alike; each run starts at a barrier and
    ends when the last rank is done (a second barrier). The first, untimed-for-the-median call
    of each is its cold figure."""
    import torch.distributed as dist

    def timed(fn) -> float:
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - start

    firsts = [timed(fn) for fn in fns]
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for fn, kept in zip(fns, times):
            kept.append(timed(fn))
    return list(zip(times, firsts))


def _count_tq_bytes() -> list[int]:
    """Wrap the torch.distributed calls tensorql makes (isend for a transfer of its own,
    all_to_all_single for the exchanges, batch_isend_irecv for the result's all-gather);
    returns the running byte count."""
    import torch.distributed as dist

    sent = [0]

    def wrap(fn, counts_on_sender):
        def wrapped(tensor, *args, **kwargs):
            if counts_on_sender(kwargs, args):
                sent[0] += tensor.nbytes
            return fn(tensor, *args, **kwargs)
        return wrapped

    original_isend = dist.isend  # what the result's all-gather passes in its P2POps
    dist.send = wrap(dist.send, lambda kw, a: True)
    dist.isend = wrap(dist.isend, lambda kw, a: True)  # a transfer of its own
    original_all_to_all = dist.all_to_all_single

    def all_to_all_single(output, input, *args, **kwargs):
        sent[0] += input.nbytes  # a rank's own split is empty: all of it crosses
        return original_all_to_all(output, input, *args, **kwargs)

    dist.all_to_all_single = all_to_all_single
    original_batch = dist.batch_isend_irecv

    def batch_isend_irecv(ops):  # the result's all-gather: pairs issued together
        sent[0] += sum(op.tensor.nbytes for op in ops if op.op is original_isend)
        return original_batch(ops)

    dist.batch_isend_irecv = batch_isend_irecv
    return sent


def _max_over_ranks(value: int) -> int:
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def tp_memory_limit(batch: int, d_model: int, d_ff: int, ranks: int) -> int:
    """The ``memory_limit`` of the ``mlp-tp`` row: the Megatron plan's largest working set on a
    rank (float32: all of x, a 1/ranks shard of W1 and of the hidden activations; W2's product
    mirrors it). Under it no rank holds both weights whole; with the row's batch of d_model / 8
    rows it is also below :func:`replicated_floor`, so no plan that replicates the weights fits
    either (at a batch of d_model / 2, the ``mlp`` row's, a 2 x 2 plan over 4 ranks -- half the
    batch each, W1 cut in 2 -- has the very same working set, moves fewer bytes, and so is
    what the optimizer picks: each rank then holds half of the weights, not a quarter).

    >>> tp_memory_limit(16, 32, 64, 2) == 4 * (16 * 32 + 32 * 32 + 16 * 32)
    True
    >>> tp_memory_limit(1024, 2048, 2048, 2) < 2 * 4 * 2048 * 2048
    True
    >>> tp_memory_limit(1024, 2048, 2048, 4) < replicated_floor(1024, 2048, 2048, 4)
    False
    >>> all(tp_memory_limit(256, 2048, 2048, k) < replicated_floor(256, 2048, 2048, k)
    ...     for k in (2, 3, 4))
    True
    """
    return 4 * (batch * d_model + math.ceil(d_model * d_ff / ranks)
                + math.ceil(batch * d_ff / ranks))


def replicated_floor(batch: int, d_model: int, d_ff: int, ranks: int) -> int:
    """The working set of the first product on a rank of the cheapest plan that replicates the
    weights (float32): two replicas of tensor parallelism over ``ranks / 2`` ranks each, half
    the batch each -- half of x's rows, a 2/ranks shard of W1 and of half the hidden rows.

    >>> replicated_floor(16, 32, 64, 4) == 4 * (8 * 32 + 32 * 32 + 8 * 32)
    True
    """
    half = math.ceil(batch / 2)
    share = min(d_ff, math.ceil(2 * d_ff / ranks))
    return 4 * (half * d_model + d_model * share + half * share)


def _is_weight(name: str, prefix: str) -> bool:
    """A model weight among a workload's stored arrays (x, masks, rotary tables and norms'
    gains are not: DTensor's modules do not count them as parameters either)."""
    return name.startswith((prefix + "w", prefix + "l0_w"))


def _sharded_mlp(db, arrays: dict, ranks: int):
    """The MLP over weights stored in K shards: W1 tiled by columns, W2 by rows."""
    d, h = arrays["mlp_w1"].shape
    cut = math.ceil(h / ranks)
    t = {"x": db.from_numpy("mlp_x", arrays["mlp_x"], replace=True),
         "w1": db.from_numpy("mlp_w1", arrays["mlp_w1"], replace=True, tile=(d, cut)),
         "w2": db.from_numpy("mlp_w2", arrays["mlp_w2"], replace=True, tile=(cut, d))}
    return (t["x"] @ t["w1"]).relu() @ t["w2"]


def _tq_weight_bytes(db, names: list[str]) -> tuple[int, int]:
    """This rank's weight memory after its runs: the bytes of the stored weights' chunks and
    regions its chunk cache holds (distinct storage: a region that is a whole chunk is the
    chunk), and of the packed copies it keeps (``kernels/packed_weights.py``)."""
    from tensorql_kernels import packed_weights

    store = db.chunk_store
    versions = store.pin(names)
    tables = {v.handle for v in versions.values()}
    store.unpin(versions.values())
    seen: dict[int, int] = {}
    for (table, _key), chunk in store.cache.items():
        if table in tables:
            storage = chunk.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values()), packed_weights.packed_bytes()


def _dtensor_side(name, arrays, prefix, head_dim, world, want, repeat):
    """DTensor's model, its comm counts, error, timing and local weight bytes."""
    from torch.distributed.tensor.debug import CommDebugMode

    model, x = _dtensor_model(name, arrays, prefix, head_dim, world)
    with torch.no_grad():
        comm = CommDebugMode()
        with comm:
            y = model(x)
        dt_err = float(np.abs(y.numpy() - want).max())
        ((samples, first),) = _alternating([lambda: model(x)], repeat) if repeat else [([], 0)]
    counts = {str(k): v for k, v in comm.get_comm_counts().items()}
    allreduce = sum(v for k, v in counts.items() if "all_reduce" in k)
    other = {k: v for k, v in counts.items() if "all_reduce" not in k}
    local = sum(p.to_local().nbytes if hasattr(p, "to_local") else p.nbytes
                for p in model.parameters())
    return {"dt_samples": samples, "dt_first": first, "dt_err": dt_err,
            "dt_bytes": 2 * (world - 1) * y.nbytes * allreduce, "allreduces": allreduce,
            "other": other, "dt_weight_bytes_rank": local}, model, x


def _dp_side(arrays, world, want, repeat):
    """torch data parallelism for the MLP: every rank holds all the weights and computes its
    rows of the batch; the output is all-gathered so that every rank ends with all of it, as
    tensorql's dense result does."""
    import torch.distributed as dist

    model, _, x = _megatron_mlp(arrays, "mlp_")
    rank = dist.get_rank()
    rows = x.shape[0] // world
    mine = x[rank * rows:(rank + 1) * rows].contiguous()
    parts = [torch.empty(rows, arrays["mlp_w2"].shape[1]) for _ in range(world)]

    def run():
        dist.all_gather(parts, model(mine))
        return torch.cat(parts)

    with torch.no_grad():
        y = run()
        dt_err = float(np.abs(y.numpy() - want).max())
        ((samples, first),) = _alternating([run], repeat) if repeat else [([], 0)]
    return {"dt_samples": samples, "dt_first": first, "dt_err": dt_err,
            "dt_bytes": (world - 1) * y.nbytes, "allreduces": 0, "other": {},
            "dt_weight_bytes_rank": sum(p.nbytes for p in model.parameters())}, run, None


def worker(out: str, name: str, size: str, repeat: int, exchange: str,
           explain: bool = False, side: str = "both", data: str = "") -> None:
    """One rank. ``name``: mlp or block (tensor parallel: tensorql's auto strategy against
    DTensor), or mlp-dp (tensorql's data strategy against torch data parallelism)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    base, dp, tp = name.split("-")[0], name.endswith("-dp"), name.endswith("-tp")
    if side == "dtensor":  # no tensorql in this process: weights and reference from the file
        dist.init_process_group("gloo")
        loaded = dict(np.load(data))
        want = loaded.pop("__reference__")
        prefix = "mlp_" if base == "mlp" else "block_"
        head_dim = 0 if base == "mlp" else SIZES[size]["block"][4]
        if dp:
            report, _, _ = _dp_side(loaded, world, want, repeat)
        else:
            report, _, _ = _dtensor_side(base, loaded, prefix, head_dim, world, want, repeat)
        report["peak_rss"] = _max_over_ranks(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                                             * 1024)
        if rank == 0:
            with open(os.path.join(out, f"{name}-{world}-dtensor.json"), "w") as f:
                json.dump(report, f)
        dist.destroy_process_group()
        return

    import tensorql as tq
    from tensorql.models import llama_block, mlp

    sent = _count_tq_bytes()
    limit = tp_memory_limit(*mlp_shape(name, size), world) if tp else None
    with tq.connect(distributed=True, workers=1, distributed_timeout_s=600,
                    distributed_exchange=exchange,
                    strategy="data" if dp else os.environ.get(STRATEGY_ENV, "auto"),
                    memory_limit=limit) as db:
        if base == "mlp":
            b, d, h = mlp_shape(name, size)
            w = mlp(db, batch=b, d_model=d, d_ff=h, prefix="mlp_")
            prefix, head_dim = "mlp_", 0
        else:
            b, s, d, heads, head_dim, ff = SIZES[size]["block"]
            w = llama_block(db, batch=b, seq=s, d_model=d, heads=heads, head_dim=head_dim,
                            d_ff=ff, prefix="block_")
            prefix = "block_"
        want = w.reference()
        want = want.numpy() if isinstance(want, torch.Tensor) else want
        query = (_sharded_mlp(db, w.arrays, world) if tp else w.output).compile()
        before = sent[0]
        got = query.run(dense=True).dense().numpy()
        tq_bytes_rank = sent[0] - before
        tq_err = float(np.abs(got - want).max())
        report: dict = {}
        if side == "both":
            if dp:
                report, peer, _ = _dp_side(w.arrays, world, want, 0)
            else:
                report, model, x = _dtensor_side(base, w.arrays, prefix, head_dim, world, want,
                                                 0)

                def peer(model=model, x=x):
                    return model(x)
            with torch.no_grad():
                (tq_s, tq_first), (dt_s, dt_first) = _alternating(
                    [lambda: query.run(dense=True), peer], repeat)
            report.update(dt_samples=dt_s, dt_first=dt_first)
        else:
            ((tq_s, tq_first),) = _alternating([lambda: query.run(dense=True)], repeat)
        if explain:  # every rank runs it; rank 0 keeps the text (per-rank busy, bytes, peaks)
            text = query.explain(analyze=True)
            if rank == 0:
                with open(os.path.join(out, f"{name}-{world}.explain.txt"), "w") as f:
                    f.write(text)
        total = torch.tensor([tq_bytes_rank], dtype=torch.int64)
        dist.all_reduce(total)
        peak = _max_over_ranks(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        weights = [n for n in w.arrays if _is_weight(n, prefix)]
        decoded, packed = _tq_weight_bytes(db, weights)
        decoded, packed = _max_over_ranks(decoded), _max_over_ranks(packed)
        if rank == 0:
            report.update({"tq_weight_bytes_rank": decoded, "tq_packed_bytes_rank": packed,
                           "weight_bytes": sum(w.arrays[n].nbytes for n in weights),
                           "memory_limit": limit})
            report.update({"tq_samples": tq_s, "tq_first": tq_first,
                           "tq_bytes": int(total.item()), "tq_err": tq_err,
                           "plan_bytes": int(query.partition.cost.bytes_moved)
                           if query.partition else 0, "tq_peak_rss": peak})
            with open(os.path.join(out, f"{name}-{world}-{side}.json"), "w") as f:
                json.dump(report, f)


def write_data(name: str, size: str, path: str) -> None:
    """The workload's arrays and its single-process reference, for the DTensor processes."""
    import tensorql as tq
    from tensorql.models import llama_block, mlp

    db = tq.connect()
    if name.split("-")[0] == "mlp":
        b, d, h = mlp_shape(name, size)
        w = mlp(db, batch=b, d_model=d, d_ff=h, prefix="mlp_")
    else:
        b, s, d, heads, head_dim, ff = SIZES[size]["block"]
        w = llama_block(db, batch=b, seq=s, d_model=d, heads=heads, head_dim=head_dim, d_ff=ff,
                        prefix="block_")
    want = w.reference()
    want = want.numpy() if isinstance(want, torch.Tensor) else want
    np.savez(path, __reference__=want, **w.arrays)
    db.close()


# -- the launcher ------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(ranks: int, name: str, size: str, repeat: int, out: str,
           exchange: str = "collective", explain: bool = False, side: str = "both",
           data: str = "", extra_env: dict | None = None) -> dict:
    port = _free_port()
    procs = []
    for rank in range(ranks):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_WORLD_SIZE=str(ranks),
                   OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", **(extra_env or {}))
        procs.append(subprocess.Popen(
            [sys.executable, __file__, "--worker", out, name, size, str(repeat), exchange,
             "explain" if explain else "-", side, data or "-"],
            env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    failed = []
    for rank, proc in enumerate(procs):
        _, err = proc.communicate(timeout=1800)
        if proc.returncode != 0:
            failed.append(f"rank {rank} exited {proc.returncode}:\n{err[-3000:]}")
    if failed:
        raise RuntimeError("\n".join(failed))
    with open(os.path.join(out, f"{name}-{ranks}-{side}.json")) as f:
        return json.load(f)


def run_row(k: int, name: str, size: str, args, out: str, rng: random.Random) -> dict:
    """One row: both sides isolated (two launches, seeded order; a third, tensorql with
    ``TENSORQL_PACKED_WEIGHTS=0``, unless ``--no-nopack``) or together."""
    if not args.isolate:
        return launch(k, name, size, args.repeat, out, args.exchange, args.explain)
    data = os.path.join(out, f"{name}.npz")
    if not os.path.exists(data):
        write_data(name, size, data)
    sides = ["tq", "dtensor", *(["nopack"] if args.nopack else [])]
    rng.shuffle(sides)
    result: dict = {"order": sides}
    for side in sides:
        if side == "nopack":  # tensorql alone, its packed weights off (read at import)
            got = launch(k, name, size, args.repeat, out, args.exchange, False, side, data,
                         {"TENSORQL_PACKED_WEIGHTS": "0"})
            result.update(nopack_samples=got["tq_samples"], nopack_first=got["tq_first"],
                          nopack_err=got["tq_err"])
            continue
        result.update(launch(k, name, size, args.repeat, out, args.exchange,
                             args.explain and side == "tq", side, data))
    return result


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        worker(argv[1], argv[2], argv[3], int(argv[4]), argv[5], argv[6] == "explain",
               argv[7], "" if argv[8] == "-" else argv[8])
        if argv[7] != "tq":
            # DTensor ran here: its functional collectives leave works un-waited ("2 unwaited
            # collective calls" at exit) and a gloo group outlives destroy_process_group, so
            # the interpreter's teardown can abort the rank (SIGABRT, "terminate called
            # without an active exception"), as it did tensorql's ranks until
            # leave_process_group freed their group. Its work and report are done: end here
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="1,2,4")
    parser.add_argument("--tq-strategy", default="auto",
                        help="tensorql's partitioning strategy in the tensor-parallel rows "
                             "(mlp, block, mlp-tp; mlp-dp runs 'data'): 'model' is the "
                             "Megatron plan DTensor runs, 'auto' the cheapest by the cost model")
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help=f"the rows to run, of {', '.join(WORKLOADS)} (default: all)")
    parser.add_argument("--exchange", choices=("collective", "p2p"), default="collective",
                        help="how tensorql moves chunks between ranks (Options."
                             "distributed_exchange)")
    parser.add_argument("--explain", action="store_true",
                        help="after timing, print rank 0's EXPLAIN ANALYZE of each run (per-rank "
                             "busy time, bytes per collective, peaks)")
    parser.add_argument("--nopack", action=argparse.BooleanOptionalAction, default=True,
                        help="also time tensorql with TENSORQL_PACKED_WEIGHTS=0 (a third "
                             "launch a row; isolated runs only; default on)")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--tiny", action="store_true", help="tiny sizes (smoke test)")
    group.add_argument("--issue-size", action="store_true",
                       help="the issue's sizes (MLP 2048x4096x4096, block d_model 2048)")
    add_arguments(parser, threads=1)
    args = parser.parse_args(argv)
    from tensorql.units import format_bytes

    size = "tiny" if args.tiny else "issue" if args.issue_size else "default"
    workloads = [n for n in args.workloads.split(",") if n]
    os.environ[STRATEGY_ENV] = args.tq_strategy  # the ranks inherit it
    unknown = sorted(set(workloads) - set(WORKLOADS))
    if unknown:
        parser.error(f"unknown workloads {unknown}; choose among {', '.join(WORKLOADS)}")
    counts = [int(k) for k in args.ranks.split(",")]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    timed = [k for k in counts if 1 < k <= (cores or 1)]
    goal_k = max(timed) if timed else None
    record = Record("distributed", smoke=args.tiny, args=args, argv=argv)
    rng = random.Random(args.seed)
    print(f"torch={torch.__version__} gloo, one torch thread per rank, repeat={args.repeat}, "
          f"tensorql strategy={args.tq_strategy}, exchange={args.exchange}, "
          f"isolate={args.isolate}, {cores} cores, sizes {SIZES[size]}")
    columns = ["workload", "ranks", "tq ms", "tq IQR", "tq cold ms", "tq nopack ms",
               "DTensor ms", "DT IQR", "DT cold ms", "tq/DT", "nopack/DT", "tq bytes MiB",
               "DT bytes MiB", "tq/DT bytes",
               "weights MiB", "tq limit/rank MiB", "tq weights/rank MiB",
               "tq packed/rank MiB", "DT weights/rank MiB", "tq peak RSS MiB",
               "DT peak RSS MiB", "tq err", "DT err", "row"]
    rows = []
    with tempfile.TemporaryDirectory() as out:
        for name in workloads:
            for k in counts:
                r = run_row(k, name, size, args, out, rng)
                tq_t = Timing(r["tq_samples"], r["tq_first"], isolated=args.isolate)
                dt_t = Timing(r["dt_samples"], r["dt_first"], isolated=args.isolate)
                timings = {"tq": tq_t, "dtensor": dt_t}
                if "nopack_samples" in r:
                    timings["tq nopack"] = Timing(r["nopack_samples"], r["nopack_first"],
                                                  isolated=True)
                record.timings(f"{name} ranks={k}", timings)
                ratio = tq_t.median / dt_t.median
                nopack = timings["tq nopack"].median if "tq nopack" in timings else None
                byte_ratio = (r["tq_bytes"] / r["dt_bytes"]) if r["dt_bytes"] else float("nan")
                kind = ("timing" if k <= (cores or 1) else "correctness only (ranks > cores)")
                rows.append([name, k, tq_t.median * 1e3, tq_t.summary()["iqr"] * 1e3,
                             tq_t.first_s * 1e3, None if nopack is None else nopack * 1e3,
                             dt_t.median * 1e3, dt_t.summary()["iqr"] * 1e3,
                             dt_t.first_s * 1e3, ratio,
                             None if nopack is None else nopack / dt_t.median,
                             r["tq_bytes"] / 2**20, r["dt_bytes"] / 2**20, byte_ratio,
                             r["weight_bytes"] / 2**20,
                             None if r["memory_limit"] is None else r["memory_limit"] / 2**20,
                             r["tq_weight_bytes_rank"] / 2**20,
                             r["tq_packed_bytes_rank"] / 2**20,
                             r["dt_weight_bytes_rank"] / 2**20,
                             r.get("tq_peak_rss", 0) / 2**20,
                             r["peak_rss"] / 2**20 if "peak_rss" in r else None,
                             r["tq_err"], r["dt_err"], kind])
                print("| " + " | ".join(cell(v) for v in rows[-1]) + " |", flush=True)
                if r["other"]:
                    print(f"  DTensor also ran {r['other']}")
                if args.explain:
                    with open(os.path.join(out, f"{name}-{k}.explain.txt")) as f:
                        print(f.read(), flush=True)
                record.check(f"{name} ranks={k}: tensorql error {r['tq_err']:.1e} < 1e-3",
                             r["tq_err"] < 1e-3)
                if "nopack_err" in r:
                    record.check(f"{name} ranks={k}: tensorql nopack error "
                                 f"{r['nopack_err']:.1e} < 1e-3", r["nopack_err"] < 1e-3)
                peer = "torch DP" if name.endswith("-dp") else "DTensor"
                record.check(f"{name} ranks={k}: {peer} error {r['dt_err']:.1e} < 1e-3",
                             r["dt_err"] < 1e-3)
                if name.endswith("-tp"):  # the row's premise: the weights are not replicated
                    if k > 1:
                        record.check(f"{name} ranks={k}: memory_limit "
                                     f"{format_bytes(r['memory_limit'])} < the weights' "
                                     f"{format_bytes(r['weight_bytes'])}",
                                     r["memory_limit"] < r["weight_bytes"])
                        floor = replicated_floor(*mlp_shape(name, size), k)
                        record.check(f"{name} ranks={k}: memory_limit "
                                     f"{format_bytes(r['memory_limit'])} < "
                                     f"{format_bytes(floor)}, the least a plan replicating "
                                     f"the weights needs", r["memory_limit"] < floor)
                    share = math.ceil(r["weight_bytes"] / k)
                    record.check(f"{name} ranks={k}: tensorql holds "
                                 f"{format_bytes(r['tq_weight_bytes_rank'])} of the weights a "
                                 f"rank <= 1/{k} of {format_bytes(r['weight_bytes'])}",
                                 r["tq_weight_bytes_rank"] <= share)
                if k == goal_k:
                    record.goal(f"{name} ranks={k}: tq/{peer} time {ratio_text(ratio, 1.0)} <= 1.0",
                                ratio <= 1.0)
                    record.goal(f"{name} ranks={k}: bytes "
                                f"{ratio_text(byte_ratio, 1.0)} <= {peer}'s",
                                r["tq_bytes"] <= r["dt_bytes"])
    if goal_k is None:
        print(f"no row with 1 < ranks <= {cores} cores: no timing goal checked")
    record.table("main", columns, rows, note="One torch thread per rank on both sides; "
                 "DTensor bytes: all-reduces priced at 2 (K-1) S; mlp-dp: tensorql's data "
                 "strategy against torch data parallelism (all-gather priced at (K-1) S) in the "
                 "DTensor columns; nopack: tensorql with TENSORQL_PACKED_WEIGHTS=0; mlp-tp: "
                 "tensorql under a per-rank memory_limit below the weights' bytes, weights "
                 "stored in K shards, against DTensor's Megatron plan; weights/rank: "
                 "tensorql's decoded weight chunks in its chunk cache (packed copies apart), "
                 "DTensor's local shards; rows with more ranks than cores check correctness "
                 "only.")
    return record.finish()


if __name__ == "__main__":
    sys.exit(main())
