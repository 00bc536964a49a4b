"""``tensorql train-demo``: an MLP classifier on scikit-learn's handwritten digits, trained by
tensorql (autodiff + Adam, checkpointed in a DuckDB file) next to the identical PyTorch model.

The data set ships inside scikit-learn (no download): 1797 8x8 images, 10 classes; a fixed
split keeps 360 for testing. Both models start from the same weights and take full-batch Adam
steps; the demo prints both loss curves' largest difference and the test accuracy.

    tensorql train-demo [--steps 200] [--db FILE] [--devices N] [--checkpoint-every K (100)]

Run again on the same ``--db`` file and training resumes from the last checkpoint.

>>> result = train_tensorql(steps=3, hidden=16)
>>> len(result.losses), result.losses[0] > result.losses[-1]
(3, True)
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

import tensorql as tq
from tensorql.units import positive_int

WEIGHTS = ("W1", "b1", "W2", "b2")


@dataclass(frozen=True)
class Digits:
    """The digits split: features scaled to [0, 1], one-hot training labels."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray

    @property
    def onehot(self) -> np.ndarray:
        return np.eye(10, dtype=self.x_train.dtype)[self.y_train]


def load_digits(dtype: str = "float32", test: int = 360, seed: int = 0) -> Digits:
    """scikit-learn's digits, shuffled with ``seed`` and split (``test`` images held out)."""
    from sklearn.datasets import load_digits as sk_digits

    data = sk_digits()
    order = np.random.default_rng(seed).permutation(len(data.target))
    x = (data.data[order] / 16.0).astype(dtype)
    y = data.target[order].astype(np.int64)
    return Digits(x[test:], y[test:], x[:test], y[:test])


def initial_weights(hidden: int = 128, dtype: str = "float32",
                    seed: int = 0) -> dict[str, np.ndarray]:
    """The starting weights both models use (torch's default Linear initialisation)."""
    torch.manual_seed(seed)
    first, second = torch.nn.Linear(64, hidden), torch.nn.Linear(hidden, 10)
    out = {"W1": first.weight.T, "b1": first.bias, "W2": second.weight.T, "b2": second.bias}
    return {k: v.detach().numpy().astype(dtype).copy() for k, v in out.items()}


def loss_of(w: dict, x, onehot, n: int):
    """Mean cross-entropy of the MLP ``relu(x W1 + b1) W2 + b2`` (any tensor library)."""
    logits = (x @ w["W1"] + w["b1"]).relu() @ w["W2"] + w["b2"]
    return -(onehot * logits.log_softmax(axis=1)).sum() * (1.0 / n)


@dataclass(frozen=True)
class TrainResult:
    losses: list[float]
    weights: dict[str, np.ndarray]
    accuracy: float
    seconds: float


# Steps between checkpoints by default: each checkpoint stores the 4 weights and their Adam
# slots (~0.15 s here, against ~3 ms a step), so a checkpoint every 10 steps made the demo 8x
# slower than its steps; every 100 keeps it within ~1.5x, and the run's end is always saved.
CHECKPOINT_EVERY = 100


def accuracy(weights: dict[str, np.ndarray], data: Digits) -> float:
    h = np.maximum(data.x_test @ weights["W1"] + weights["b1"], 0)
    predicted = (h @ weights["W2"] + weights["b2"]).argmax(axis=1)
    return float((predicted == data.y_test).mean())


def train_tensorql(steps: int = 200, *, hidden: int = 128, lr: float = 0.01,
                   db_path: str | None = None, devices=None, checkpoint_every: int = 1,
                   dtype: str = "float32", deterministic: bool = False) -> TrainResult:
    """Train (or resume, when ``db_path`` holds a checkpoint) up to ``steps`` steps;
    ``deterministic`` (Options.deterministic) makes a resumed run bit-identical to an
    uninterrupted one."""
    data = load_digits(dtype)
    db = tq.connect(db_path, devices=devices, deterministic=deterministic or None)
    if not db.chunk_store.has("adam.step"):
        db.store_many({"digits.x": data.x_train, "digits.onehot": data.onehot,
                       **initial_weights(hidden, dtype)}, replace=True)
    opt = tq.optim.Adam(db, list(WEIGHTS), lr=lr, checkpoint_every=checkpoint_every)
    loss = loss_of(opt.params(), db.tensor("digits.x"), db.tensor("digits.onehot"),
                   len(data.y_train))
    losses = []
    start = time.perf_counter()
    while opt.step_count < steps:
        losses.append(opt.step(loss))
    seconds = time.perf_counter() - start
    opt.checkpoint()
    weights = {k: db.tensor(k).numpy() for k in WEIGHTS}
    db.close()
    return TrainResult(losses, weights, accuracy(weights, data), seconds)


def train_torch(steps: int = 200, *, hidden: int = 128, lr: float = 0.01,
                dtype: str = "float32") -> TrainResult:
    """The identical model in PyTorch (torch.optim.Adam, same start, same data)."""
    data = load_digits(dtype)
    w = {k: torch.tensor(v, requires_grad=True) for k, v in initial_weights(hidden, dtype).items()}
    x, onehot = torch.tensor(data.x_train), torch.tensor(data.onehot)
    opt = torch.optim.Adam(list(w.values()), lr=lr, foreach=False)

    losses = []
    start = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad()
        logits = torch.relu(x @ w["W1"] + w["b1"]) @ w["W2"] + w["b2"]
        loss = -(onehot * torch.log_softmax(logits, dim=1)).sum() * (1.0 / len(data.y_train))
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    seconds = time.perf_counter() - start
    weights = {k: v.detach().numpy() for k, v in w.items()}
    return TrainResult(losses, weights, accuracy(weights, data), seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tensorql train-demo", description=__doc__.split(
        "\n\n")[0])
    parser.add_argument("--steps", type=positive_int, default=200,
                        help="Adam steps to train (a resumed run goes on to this many)")
    parser.add_argument("--db", default=None, help="DuckDB file for checkpoints (resumes)")
    parser.add_argument("--devices", default=None,
                        help="devices to run on: N CPU devices, 'cpu', 'cuda' (default: auto)")
    parser.add_argument("--checkpoint-every", type=positive_int, default=CHECKPOINT_EVERY,
                        metavar="K",
                        help="steps between checkpoints (default %(default)s; the last step "
                             "is always checkpointed); each checkpoint writes every weight "
                             "and Adam slot to DuckDB, ~0.15 s for this model")
    parser.add_argument("--deterministic", action="store_true",
                        help="bit-identical runs (one worker thread; resumes exactly)")
    args = parser.parse_args(argv)
    devices = int(args.devices) if args.devices and args.devices.isdigit() else args.devices
    ours = train_tensorql(args.steps, db_path=args.db, devices=devices,
                          checkpoint_every=args.checkpoint_every,
                          deterministic=args.deterministic)
    theirs = train_torch(args.steps)
    done = len(ours.losses)
    gap = max((abs(a - b) for a, b in zip(ours.losses, theirs.losses[-done:])), default=0.0)
    print(f"tensorql: {done} steps in {ours.seconds:.2f} s, final loss "
          f"{ours.losses[-1] if ours.losses else float('nan'):.4f}, test accuracy "
          f"{ours.accuracy:.3f}")
    print(f"torch:    {args.steps} steps in {theirs.seconds:.2f} s, final loss "
          f"{theirs.losses[-1]:.4f}, test accuracy {theirs.accuracy:.3f}")
    print(f"largest loss difference over the curve: {gap:.2e}")
    ok = ours.accuracy >= 0.95 and gap <= 1e-4
    print("OK" if ok else "MISMATCH", file=sys.stdout)
    return 0 if ok else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
