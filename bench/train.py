"""One training step, tensorql against PyTorch in the same run: an MLP classifier and a LLaMA
block, Adam on both sides, same weights, same data.

    python bench/train.py [--repeat 5] [--tiny] [--mlp-only | --block-only]

* **MLP**: batch 256, 784 -> 2048 -> 2048 -> 10 with ReLU, mean cross-entropy (log-softmax);
* **LLaMA block**: ``tensorql.models.llama_block`` (RMSNorm, rotary attention with a causal
  mask, SwiGLU), batch 1, 256 tokens, d_model 512, 8 heads of 64, d_ff 1376; loss = mean of
  the output's squares; every weight of the block is trained.

tensorql's step is ``Adam.step(loss)``: forward, gradients (``tq.grad``) and the update of
every weight and Adam slot planned and run as one query (checkpointing off: the step alone is
timed; the checkpoint's cost is printed apart). torch's step is ``zero_grad``, forward,
``backward`` and ``torch.optim.Adam.step``. Each side warms up one step, then ``--repeat``
steps of each run in turn (tensorql, torch, tensorql, ...) and their medians are reported;
the two losses after each step are compared.

Both sides run in one process with the C allocator tuned by tensorql
(``tensorql.exec.host_malloc``: freed buffers are reused rather than unmapped), set before
either runs; while tensorql's step runs, no request is mapped on its own (``heap_only``).
Peak memory: the process's peak resident set above what it held before the step (Linux
``VmHWM`` after resetting it through ``/proc/self/clear_refs``), for each side.

Goals (this CPU): MLP tq/torch <= 1.2, LLaMA block tq/torch <= 1.3.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from timing import alternating_medians  # noqa: E402  (bench/timing.py)

import tensorql as tq  # noqa: E402
from tensorql.exec.host_malloc import tune_malloc  # noqa: E402
from tensorql.models import llama_block  # noqa: E402

SIZES = {
    "default": {"mlp": (256, 784, 2048, 2048, 10), "block": (1, 256, 512, 8, 64, 1376)},
    "tiny": {"mlp": (16, 24, 32, 32, 10), "block": (1, 8, 16, 2, 8, 24)},
}
GOALS = {"mlp": 1.2, "block": 1.3}


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def peak_above_baseline(fn) -> int:
    """Bytes of resident memory ``fn`` added at its peak (0 where /proc cannot tell)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark
    except OSError:
        return 0
    before = _rss_kib("VmRSS")
    fn()
    return max(0, _rss_kib("VmHWM") - before) * 1024


def timed_pair(ours, theirs, repeat: int) -> tuple[float, int, float, int]:
    """(our median seconds, our peak bytes, theirs, their peak) a step: each warmed up
    (plans, caches, allocator) and its peak taken, then ``repeat`` steps of each in turn
    (ours, theirs, ours, ...), so that a drifting host weighs on both alike."""
    ours()
    theirs()
    our_peak, their_peak = peak_above_baseline(ours), peak_above_baseline(theirs)
    our_time, their_time = alternating_medians([ours, theirs], repeat)
    return our_time, our_peak, their_time, their_peak


def mlp_case(size: str, repeat: int) -> dict:
    batch, d_in, h1, h2, classes = SIZES[size]["mlp"]
    rng = np.random.default_rng(0)
    x = rng.random((batch, d_in), dtype=np.float32)
    onehot = np.eye(classes, dtype=np.float32)[rng.integers(0, classes, batch)]
    torch.manual_seed(0)
    layers = [torch.nn.Linear(a, b) for a, b in ((d_in, h1), (h1, h2), (h2, classes))]
    start = {}
    for k, layer in enumerate(layers, start=1):
        start[f"W{k}"] = layer.weight.detach().T.contiguous().numpy()
        start[f"b{k}"] = layer.bias.detach().numpy().copy()

    def model(w, xs, ys, softmax):
        h = (xs @ w["W1"] + w["b1"]).relu()
        h = (h @ w["W2"] + w["b2"]).relu()
        logits = h @ w["W3"] + w["b3"]
        return -(ys * softmax(logits)).sum() * (1.0 / batch)

    db = tq.connect()
    db.store_many({"x": x, "onehot": onehot, **start})
    opt = tq.optim.Adam(db, list(start), lr=1e-3, checkpoint_every=10 ** 9)
    loss = model({k: db.tensor(k) for k in start}, db.tensor("x"), db.tensor("onehot"),
                 lambda t: t.log_softmax(axis=1))
    tq_losses: list[float] = []

    w = {k: torch.tensor(v, requires_grad=True) for k, v in start.items()}
    xt, yt = torch.from_numpy(x), torch.from_numpy(onehot)
    topt = torch.optim.Adam(list(w.values()), lr=1e-3)
    torch_losses: list[float] = []

    def torch_step():
        topt.zero_grad()
        value = model(w, xt, yt, lambda t: torch.log_softmax(t, dim=1))
        value.backward()
        topt.step()
        torch_losses.append(float(value.detach()))

    tq_time, tq_peak, torch_time, torch_peak = timed_pair(
        lambda: tq_losses.append(opt.step(loss)), torch_step, repeat)
    ckpt_start = time.perf_counter()
    opt.checkpoint()
    ckpt = time.perf_counter() - ckpt_start
    return dict(name=f"MLP {batch}x{d_in}x{h1}x{h2}x{classes}", tq=tq_time, torch=torch_time,
                tq_peak=tq_peak, torch_peak=torch_peak, checkpoint=ckpt,
                loss_gap=max(abs(a - b) for a, b in zip(tq_losses, torch_losses)),
                goal=GOALS["mlp"])


def block_case(size: str, repeat: int) -> dict:
    b, s, d, heads, head_dim, ff = SIZES[size]["block"]
    db = tq.connect()
    work = llama_block(db, batch=b, seq=s, d_model=d, heads=heads, head_dim=head_dim, d_ff=ff,
                       prefix="blk_")
    names = sorted(n for n in work.arrays if n.startswith("blk_l0_"))
    opt = tq.optim.Adam(db, names, lr=1e-4, checkpoint_every=10 ** 9)
    out = work.output
    loss = (out * out).mean()
    tq_losses: list[float] = []

    leaves = {n: torch.tensor(work.arrays[n], requires_grad=True) for n in names}
    topt = torch.optim.Adam(list(leaves.values()), lr=1e-4)
    torch_losses: list[float] = []

    def torch_step():
        topt.zero_grad()
        y = work.reference_with(leaves)
        value = (y * y).mean()
        value.backward()
        topt.step()
        torch_losses.append(float(value.detach()))

    tq_time, tq_peak, torch_time, torch_peak = timed_pair(
        lambda: tq_losses.append(opt.step(loss)), torch_step, repeat)
    return dict(name=f"LLaMA block b{b} s{s} d{d} h{heads}x{head_dim} ff{ff}", tq=tq_time,
                torch=torch_time, tq_peak=tq_peak, torch_peak=torch_peak, checkpoint=None,
                loss_gap=max(abs(a - b) for a, b in zip(tq_losses, torch_losses)),
                goal=GOALS["block"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--tiny", action="store_true", help="smallest sizes (a smoke run)")
    parser.add_argument("--mlp-only", action="store_true")
    parser.add_argument("--block-only", action="store_true")
    args = parser.parse_args(argv)
    tune_malloc()  # before either side runs: both reuse freed buffers alike
    size = "tiny" if args.tiny else "default"
    rows = []
    if not args.block_only:
        rows.append(mlp_case(size, args.repeat))
    if not args.mlp_only:
        rows.append(block_case(size, args.repeat))
    print("| step | tq ms | torch ms | tq/torch | goal | tq peak MiB | torch peak MiB | "
          "loss gap |")
    print("|---|---|---|---|---|---|---|---|")
    met = True
    for r in rows:
        ratio = r["tq"] / r["torch"]
        met &= ratio <= r["goal"]
        print(f"| {r['name']} | {r['tq'] * 1e3:.1f} | {r['torch'] * 1e3:.1f} | {ratio:.2f} | "
              f"<= {r['goal']} | {r['tq_peak'] / 2**20:.1f} | {r['torch_peak'] / 2**20:.1f} | "
              f"{r['loss_gap']:.1e} |")
        if r["checkpoint"] is not None:
            print(f"  (a checkpoint of its weights and Adam state: {r['checkpoint'] * 1e3:.0f} ms)")
    print(f"goals: {'met' if met else 'NOT met'} (torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads)")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
