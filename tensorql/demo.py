"""The main job: a two-layer MLP and a multi-head attention block on random data, stored in an
embedded DuckDB file, planned and run in chunks, explained, and checked against plain torch.

    tensorql demo [--db FILE] [--batch 512] [--width 256]

Exits 1 if tensorql's results disagree with torch's.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np
import torch

import tensorql as tq
from tensorql.units import positive_int


def _mlp(db, rng, batch, width):
    x = rng.standard_normal((batch, width), dtype=np.float32)
    w1 = rng.standard_normal((width, 4 * width), dtype=np.float32) / np.float32(width ** 0.5)
    w2 = rng.standard_normal((4 * width, width), dtype=np.float32) / np.float32(
        (4 * width) ** 0.5)
    tile = (128, 128)
    X = db.from_numpy("mlp_x", x, tile=tile, replace=True)
    W1 = db.from_numpy("mlp_w1", w1, tile=tile, replace=True)
    W2 = db.from_numpy("mlp_w2", w2, tile=tile, replace=True)
    expr = (X @ W1).relu() @ W2
    reference = torch.relu(torch.from_numpy(x) @ torch.from_numpy(w1)) @ torch.from_numpy(w2)
    return "two-layer MLP  relu(X @ W1) @ W2", expr, reference


def _attention(db, rng, seq, width, heads=4):
    d = width // heads
    x = rng.standard_normal((seq, width), dtype=np.float32)
    wq, wk, wv = (rng.standard_normal((width, heads, d), dtype=np.float32)
                  / np.float32(width ** 0.5) for _ in range(3))
    wo = rng.standard_normal((heads, d, width), dtype=np.float32) / np.float32(width ** 0.5)
    X = db.from_numpy("attn_x", x, tile=(128, 128), replace=True)
    Wq, Wk, Wv = (db.from_numpy(f"attn_w{n}", w, tile=(128, heads, d), replace=True)
                  for n, w in zip("qkv", (wq, wk, wv)))
    Wo = db.from_numpy("attn_wo", wo, tile=(heads, d, 128), replace=True)
    q = tq.einsum("sm,mhd->hsd", X, Wq)
    k = tq.einsum("sm,mhd->hsd", X, Wk)
    v = tq.einsum("sm,mhd->hsd", X, Wv)
    scores = tq.einsum("hsd,htd->hst", q, k) * (1.0 / d ** 0.5)
    probs = scores.softmax(axis=-1)
    out = tq.einsum("hst,htd,hdm->sm", probs, v, Wo)
    tx = torch.from_numpy(x)
    tq_, tk, tv = (torch.einsum("sm,mhd->hsd", tx, torch.from_numpy(w)) for w in (wq, wk, wv))
    p = torch.softmax(torch.einsum("hsd,htd->hst", tq_, tk) / d ** 0.5, dim=-1)
    reference = torch.einsum("hst,htd,hdm->sm", p, tv, torch.from_numpy(wo))
    return f"attention block ({heads} heads, softmax as einsums)", out, reference


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tensorql demo", description=_description())
    parser.add_argument("--db", help="DuckDB file (default: a temporary file)")
    parser.add_argument("--batch", type=positive_int, default=512,
                        help="rows of the input batch (default: 512)")
    parser.add_argument("--width", type=positive_int, default=256,
                        help="hidden width of the MLP and the attention (default: 256)")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        path = args.db or os.path.join(tmp, "demo.duckdb")
        rng = np.random.default_rng(7)
        failures = 0
        with tq.connect(path) as db:
            print(f"tensorql {tq.__version__}: database {path}, {db.options.workers} worker(s)\n")
            jobs = [_mlp(db, rng, args.batch, args.width),
                    _attention(db, rng, args.batch, args.width)]
            for title, expr, reference in jobs:
                print(f"== {title}")
                print(expr.explain(analyze=True))
                start = time.perf_counter()
                stored = db.store(title.split()[0].lower() + "_out", expr, replace=True)
                elapsed = time.perf_counter() - start
                got = torch.from_numpy(np.asarray(stored.numpy()))
                err = float((got - reference).abs().max() / reference.abs().max())
                status = "OK" if err < 1e-4 else "MISMATCH"
                failures += status != "OK"
                print(f"-> stored as {stored.node.name!r} {stored.shape} in {elapsed:.3f}s; "
                      f"max relative difference vs torch {err:.2e}: {status}\n")
            print(f"stored tensors: {', '.join(db.tensors())}")
        print("demo " + ("passed" if not failures else f"FAILED ({failures} mismatch)"))
        return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())


def _description() -> str:
    """The module docstring's first paragraph (argparse would cut it at the first line)."""
    return " ".join(__doc__.split("\n\n")[0].split())
