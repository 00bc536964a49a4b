"""tensorql on torch.distributed against PyTorch DTensor with Megatron sharding, same run.

    python bench/distributed.py [--ranks 1,2,4] [--repeat 3] [--issue-size | --tiny]

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
Goals (K = 4): tensorql wall time <= 1.0x DTensor's, bytes <= DTensor's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

SIZES = {
    "tiny": {"mlp": (16, 32, 64), "block": (1, 16, 32, 4, 8, 48)},
    "default": {"mlp": (1024, 2048, 2048), "block": (1, 256, 1024, 8, 128, 2816)},
    "issue": {"mlp": (2048, 4096, 4096), "block": (1, 512, 2048, 16, 128, 5632)},
}


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


def _alternating(fns, repeat: int) -> list[float]:
    """Median seconds of each of ``fns`` across the ranks, run in turn (A, B, A, B, ...) so
    that a host whose speed drifts weighs on both alike; each run starts at a barrier and
    ends when the last rank is done (a second barrier)."""
    import torch.distributed as dist

    for fn in fns:
        fn()  # warm up
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for fn, kept in zip(fns, times):
            dist.barrier()
            start = time.perf_counter()
            fn()
            dist.barrier()
            kept.append(time.perf_counter() - start)
    return [statistics.median(kept) for kept in times]


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


def worker(out: str, name: str, size: str, repeat: int, exchange: str,
           explain: bool = False) -> None:
    import torch.distributed as dist

    import tensorql as tq
    from tensorql.models import llama_block, mlp

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    sent = _count_tq_bytes()
    with tq.connect(distributed=True, workers=1, distributed_timeout_s=600,
                    distributed_exchange=exchange) as db:
        if name == "mlp":
            b, d, h = SIZES[size]["mlp"]
            w = mlp(db, batch=b, d_model=d, d_ff=h, prefix="mlp_")
            prefix, head_dim = "mlp_", 0
        else:
            b, s, d, heads, head_dim, ff = SIZES[size]["block"]
            w = llama_block(db, batch=b, seq=s, d_model=d, heads=heads, head_dim=head_dim,
                            d_ff=ff, prefix="block_")
            prefix = "block_"
        want = w.reference()
        want = want.numpy() if isinstance(want, torch.Tensor) else want
        query = w.output.compile()
        before = sent[0]
        got = query.run(dense=True).dense().numpy()
        tq_bytes_rank = sent[0] - before
        tq_err = float(np.abs(got - want).max())

        model, x = _dtensor_model(name, w.arrays, prefix, head_dim, world)
        from torch.distributed.tensor.debug import CommDebugMode

        with torch.no_grad():
            comm = CommDebugMode()
            with comm:
                y = model(x)
            dt_err = float(np.abs(y.numpy() - want).max())
            tq_s, dt_s = _alternating([lambda: query.run(dense=True), lambda: model(x)],
                                      repeat)
        if explain:  # every rank runs it; rank 0 keeps the text (per-rank busy, bytes, peaks)
            text = query.explain(analyze=True)
            if rank == 0:
                with open(os.path.join(out, f"{name}-{world}.explain.txt"), "w") as f:
                    f.write(text)
        counts = {str(k): v for k, v in comm.get_comm_counts().items()}
        allreduce = sum(v for k, v in counts.items() if "all_reduce" in k)
        other = {k: v for k, v in counts.items() if "all_reduce" not in k}
        out_bytes = y.nbytes  # every all-reduce here reduces an output of x's shape
        dt_bytes = 2 * (world - 1) * out_bytes * allreduce
        total = torch.tensor([tq_bytes_rank], dtype=torch.int64)
        dist.all_reduce(total)
        if rank == 0:
            with open(os.path.join(out, f"{name}-{world}.json"), "w") as f:
                json.dump({"tq_s": tq_s, "dt_s": dt_s, "tq_bytes": int(total.item()),
                           "dt_bytes": dt_bytes, "allreduces": allreduce, "other": other,
                           "tq_err": tq_err, "dt_err": dt_err,
                           "plan_bytes": int(query.partition.cost.bytes_moved)
                           if query.partition else 0}, f)


# -- the launcher ------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(ranks: int, name: str, size: str, repeat: int, out: str,
           exchange: str = "collective", explain: bool = False) -> dict:
    port = _free_port()
    procs = []
    for rank in range(ranks):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_WORLD_SIZE=str(ranks),
                   OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(
            [sys.executable, __file__, "--worker", out, name, size, str(repeat), exchange,
             "explain" if explain else "-"],
            env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    failed = []
    for rank, proc in enumerate(procs):
        _, err = proc.communicate(timeout=1800)
        if proc.returncode != 0:
            failed.append(f"rank {rank} exited {proc.returncode}:\n{err[-3000:]}")
    if failed:
        raise RuntimeError("\n".join(failed))
    with open(os.path.join(out, f"{name}-{ranks}.json")) as f:
        return json.load(f)


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        worker(argv[1], argv[2], argv[3], int(argv[4]), argv[5], argv[6] == "explain")
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="1,2,4")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--exchange", choices=("collective", "p2p"), default="collective",
                        help="how tensorql moves chunks between ranks (Options."
                             "distributed_exchange)")
    parser.add_argument("--explain", action="store_true",
                        help="after timing, print rank 0's EXPLAIN ANALYZE of each run (per-rank "
                             "busy time, bytes per collective, peaks)")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--tiny", action="store_true", help="tiny sizes (smoke test)")
    group.add_argument("--issue-size", action="store_true",
                       help="the issue's sizes (MLP 2048x4096x4096, block d_model 2048)")
    args = parser.parse_args(argv)
    size = "tiny" if args.tiny else "issue" if args.issue_size else "default"
    counts = [int(k) for k in args.ranks.split(",")]
    print(f"torch={torch.__version__} gloo, one torch thread per rank, repeat={args.repeat}, "
          f"exchange={args.exchange}, sizes {SIZES[size]}")
    print(f"{'workload':9} {'ranks':>5} {'tq s':>8} {'DTensor s':>9} {'tq/DT':>6} "
          f"{'tq bytes':>12} {'DT bytes':>12} {'tq/DT bytes':>11} {'tq err':>8} {'DT err':>8}")
    ok = True
    with tempfile.TemporaryDirectory() as out:
        for name in ("mlp", "block"):
            for k in counts:
                r = launch(k, name, size, args.repeat, out, args.exchange, args.explain)
                ratio = r["tq_s"] / r["dt_s"]
                byte_ratio = (r["tq_bytes"] / r["dt_bytes"]) if r["dt_bytes"] else float("nan")
                print(f"{name:9} {k:5d} {r['tq_s']:8.3f} {r['dt_s']:9.3f} {ratio:6.2f} "
                      f"{_mib(r['tq_bytes']):>12} {_mib(r['dt_bytes']):>12} {byte_ratio:11.2f} "
                      f"{r['tq_err']:8.1e} {r['dt_err']:8.1e}", flush=True)
                if r["other"]:
                    print(f"  DTensor also ran {r['other']}")
                if args.explain:
                    with open(os.path.join(out, f"{name}-{k}.explain.txt")) as f:
                        print(f.read(), flush=True)
                ok &= r["tq_err"] < 1e-3 and r["dt_err"] < 1e-3
                if k == max(counts) and k > 1:
                    ok &= ratio <= 1.0 and r["tq_bytes"] <= r["dt_bytes"]
    print(f"goals at {max(counts)} ranks: tq/DTensor time <= 1.0 and bytes <= DTensor's:",
          "met" if ok else "NOT met")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
