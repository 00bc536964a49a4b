"""Transformer workloads over lazy Tensors, with sizes as parameters and a torch reference.

With ``materialize=True`` (default) every weight is random data stored in the session and
``reference()`` recomputes the result with plain torch; with ``materialize=False`` weights are
shape-only stored-tensor nodes, enough to plan (``tq.optimize``) a LLaMA-7B-shaped graph
without 28 GB of data.

>>> import tensorql as tq
>>> w = llama(tq.connect(), layers=2, batch=1, seq=4, d_model=8, heads=2, head_dim=4,
...           d_ff=12, materialize=True)
>>> w.output.shape, bool(abs(w.output.numpy() - w.reference()).max() < 1e-3)
((1, 4, 8), True)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tensorql.api.einsum import einsum
from tensorql.api.tensor import Tensor
from tensorql.einsum.graph import Source
from tensorql.grid import ChunkGrid, auto_tile

MASK_VALUE = -1e9


@dataclass(frozen=True, eq=False)
class Workload:
    """A built workload: its lazy ``output``, the arrays behind it and a torch reference."""

    name: str
    output: Tensor
    arrays: dict[str, np.ndarray] = field(default_factory=dict, repr=False)
    reference_fn: Callable[[], torch.Tensor] | None = field(default=None, repr=False)
    params: Any = field(default=None, repr=False, compare=False)

    def reference(self) -> np.ndarray:
        """The result computed with plain torch (materialized workloads only)."""
        if self.reference_fn is None:
            raise ValueError(f"workload {self.name!r} was built without data")
        return self.reference_fn().numpy()

    def reference_with(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """The torch reference computed from ``tensors`` (stored name -> torch tensor, e.g.
        leaves with ``requires_grad`` for a training step) in place of the stored arrays."""
        if self.reference_fn is None or self.params is None:
            raise ValueError(f"workload {self.name!r} was built without data")
        self.params.overrides = dict(tensors)
        try:
            return self.reference_fn()
        finally:
            self.params.overrides = {}


class _Params:
    """Creates named inputs: stored random arrays, or shape-only nodes."""

    def __init__(self, db, prefix: str, materialize: bool, seed: int) -> None:
        self.db = db
        self.prefix = prefix
        self.materialize = materialize
        self.rng = np.random.default_rng(seed)
        self.arrays: dict[str, np.ndarray] = {}
        self.overrides: dict[str, torch.Tensor] = {}

    def __call__(self, name: str, shape: tuple[int, ...], scale: float = 1.0,
                 value: np.ndarray | None = None) -> Tensor:
        full = f"{self.prefix}{name}"
        if not self.materialize:
            grid = ChunkGrid(shape, auto_tile(shape))
            return Tensor(Source(shape=shape, dtype="float32", name=full, grid=grid), self.db)
        if value is None:
            value = (self.rng.standard_normal(shape) * scale).astype(np.float32)
        self.arrays[full] = value
        return self.db.from_numpy(full, value, replace=True)

    def t(self, name: str) -> torch.Tensor:
        full = f"{self.prefix}{name}"
        if full in self.overrides:
            return self.overrides[full]
        return torch.from_numpy(self.arrays[full])


def _reference(params: _Params, fn: Callable[[], torch.Tensor]) -> Callable | None:
    return fn if params.materialize else None


def mlp(db, batch: int = 64, d_model: int = 512, d_ff: int = 2048, *, materialize: bool = True,
        seed: int = 0, prefix: str = "mlp_") -> Workload:
    """``relu(x @ W1) @ W2`` with x (batch, d_model), W1 (d_model, d_ff), W2 (d_ff, d_model)."""
    p = _Params(db, prefix, materialize, seed)
    x = p("x", (batch, d_model))
    w1 = p("w1", (d_model, d_ff), 1 / math.sqrt(d_model))
    w2 = p("w2", (d_ff, d_model), 1 / math.sqrt(d_ff))
    out = (x @ w1).relu() @ w2
    return Workload("mlp", out, p.arrays, _reference(
        p, lambda: torch.relu(p.t("x") @ p.t("w1")) @ p.t("w2")), p)


def _causal_mask(seq: int) -> np.ndarray:
    return np.triu(np.full((seq, seq), MASK_VALUE, dtype=np.float32), k=1)


def _attention(x: Tensor, wq: Tensor, wk: Tensor, wv: Tensor, wo: Tensor, mask: Tensor,
               head_dim: int, rope: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    q = einsum("bsd,dhe->bshe", x, wq)
    k = einsum("bsd,dhe->bshe", x, wk)
    v = einsum("bsd,dhe->bshe", x, wv)
    if rope is not None:
        q, k = rope(q), rope(k)
    scores = einsum("bshe,bthe->bhst", q, k) * (1.0 / math.sqrt(head_dim)) + mask
    probs = scores.softmax(-1)
    o = einsum("bhst,bthe->bshe", probs, v)
    return einsum("bshe,hed->bsd", o, wo)


def _torch_attention(x, wq, wk, wv, wo, mask, head_dim, rope=None):
    q = torch.einsum("bsd,dhe->bshe", x, wq)
    k = torch.einsum("bsd,dhe->bshe", x, wk)
    v = torch.einsum("bsd,dhe->bshe", x, wv)
    if rope is not None:
        q, k = rope(q), rope(k)
    scores = torch.einsum("bshe,bthe->bhst", q, k) / math.sqrt(head_dim) + mask
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("bshe,hed->bsd", torch.einsum("bhst,bthe->bshe", probs, v), wo)


def attention(db, batch: int = 4, seq: int = 128, d_model: int = 512, heads: int = 8,
              head_dim: int = 64, *, causal: bool = True, materialize: bool = True,
              seed: int = 0, prefix: str = "attn_") -> Workload:
    """Multi-head self-attention over x (batch, seq, d_model), softmax over keys."""
    p = _Params(db, prefix, materialize, seed)
    x = p("x", (batch, seq, d_model))
    ws = [p(n, (d_model, heads, head_dim), 1 / math.sqrt(d_model)) for n in ("wq", "wk", "wv")]
    wo = p("wo", (heads, head_dim, d_model), 1 / math.sqrt(heads * head_dim))
    mask_np = _causal_mask(seq) if causal else np.zeros((seq, seq), dtype=np.float32)
    mask = p("mask", (seq, seq), value=mask_np)
    out = _attention(x, *ws, wo, mask, head_dim)
    return Workload("attention", out, p.arrays, _reference(p, lambda: _torch_attention(
        p.t("x"), p.t("wq"), p.t("wk"), p.t("wv"), p.t("wo"), p.t("mask"), head_dim)), p)


def _rope_tables(seq: int, head_dim: int, base: float = 10000.0):
    half = head_dim // 2
    inv = base ** (-np.arange(half, dtype=np.float64) / half)
    angles = np.outer(np.arange(seq), inv)
    cos = np.concatenate([np.cos(angles)] * 2, axis=1).astype(np.float32)
    sin = np.concatenate([np.sin(angles)] * 2, axis=1).astype(np.float32)
    rot = np.zeros((head_dim, head_dim), dtype=np.float32)  # rotate_half as a matrix
    for j in range(half):
        rot[j + half, j] = -1.0   # out[j] = -q[j + half]
        rot[j, j + half] = 1.0    # out[j + half] = q[j]
    return cos, sin, rot


def rms_norm(x: Tensor, gain: Tensor, eps: float) -> Tensor:
    """RMSNorm of ``x`` (B, S, D) with ``gain`` (D,); the mean square is one contraction of
    x with itself (no squared copy of x)."""
    inv = (einsum("bsd,bsd->bs", x, x) * (1.0 / x.shape[-1]) + eps).rsqrt()
    return einsum("bsd,bs,d->bsd", x, inv, gain)


def _torch_rmsnorm(x, gain, eps):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * gain


@dataclass(frozen=True)
class _Shared:
    cos: Tensor
    sin: Tensor
    rot: Tensor
    mask: Tensor


def _shared(p: _Params, seq: int, head_dim: int) -> _Shared:
    cos, sin, rot = _rope_tables(seq, head_dim)
    return _Shared(p("rope_cos", (seq, head_dim), value=cos),
                   p("rope_sin", (seq, head_dim), value=sin),
                   p("rope_rot", (head_dim, head_dim), value=rot),
                   p("mask", (seq, seq), value=_causal_mask(seq)))


def _block(p: _Params, x: Tensor, layer: int, shared: _Shared, d_model: int, heads: int,
           head_dim: int, d_ff: int, eps: float) -> Tensor:
    n = f"l{layer}_"
    g1 = p(n + "attn_norm", (d_model,), value=np.ones(d_model, dtype=np.float32)
           if p.materialize else None)
    ws = [p(n + w, (d_model, heads, head_dim), 1 / math.sqrt(d_model)) for w in ("wq", "wk",
                                                                                "wv")]
    wo = p(n + "wo", (heads, head_dim, d_model), 1 / math.sqrt(heads * head_dim))
    g2 = p(n + "mlp_norm", (d_model,), value=np.ones(d_model, dtype=np.float32)
           if p.materialize else None)
    w1 = p(n + "w1", (d_model, d_ff), 1 / math.sqrt(d_model))
    w3 = p(n + "w3", (d_model, d_ff), 1 / math.sqrt(d_model))
    w2 = p(n + "w2", (d_ff, d_model), 1 / math.sqrt(d_ff))

    def rope(t: Tensor) -> Tensor:
        return (einsum("bshe,se->bshe", t, shared.cos)
                + einsum("bshe,ef,sf->bshf", t, shared.rot, shared.sin))

    h = x + _attention(rms_norm(x, g1, eps), *ws, wo, shared.mask, head_dim, rope)
    hn = rms_norm(h, g2, eps)
    return h + (hn @ w1).silu() * (hn @ w3) @ w2


def _torch_block(p: _Params, x, layer: int, eps: float, head_dim: int):
    n = f"l{layer}_"
    cos, sin, rot = p.t("rope_cos"), p.t("rope_sin"), p.t("rope_rot")

    def rope(t):
        return t * cos[None, :, None, :] + torch.einsum("bshe,ef->bshf", t, rot) * \
            sin[None, :, None, :]

    h = x + _torch_attention(_torch_rmsnorm(x, p.t(n + "attn_norm"), eps), p.t(n + "wq"),
                             p.t(n + "wk"), p.t(n + "wv"), p.t(n + "wo"), p.t("mask"),
                             head_dim, rope)
    hn = _torch_rmsnorm(h, p.t(n + "mlp_norm"), eps)
    return h + (torch.nn.functional.silu(hn @ p.t(n + "w1")) * (hn @ p.t(n + "w3"))) \
        @ p.t(n + "w2")


def llama(db, layers: int = 32, batch: int = 1, seq: int = 2048, d_model: int = 4096,
          heads: int = 32, head_dim: int = 128, d_ff: int = 11008, eps: float = 1e-5, *,
          materialize: bool = False, seed: int = 0, prefix: str = "llama_") -> Workload:
    """``layers`` LLaMA decoder blocks (defaults: LLaMA-7B shapes, shape-only weights).

    Each block: RMSNorm, attention with rotary embeddings from precomputed cos/sin tables
    (shared by all layers) and a causal mask, residual, RMSNorm, SwiGLU MLP, residual.
    """
    p = _Params(db, prefix, materialize, seed)
    x = p("x", (batch, seq, d_model))
    shared = _shared(p, seq, head_dim)
    out = x
    for layer in range(layers):
        out = _block(p, out, layer, shared, d_model, heads, head_dim, d_ff, eps)

    def reference() -> torch.Tensor:
        y = p.t("x")
        for layer in range(layers):
            y = _torch_block(p, y, layer, eps, head_dim)
        return y

    return Workload(f"llama{layers}", out, p.arrays, _reference(p, reference), p)


def llama_block(db, batch: int = 2, seq: int = 64, d_model: int = 256, heads: int = 4,
                head_dim: int = 64, d_ff: int = 688, eps: float = 1e-5, *,
                materialize: bool = True, seed: int = 0, prefix: str = "block_") -> Workload:
    """One LLaMA decoder block (see :func:`llama`)."""
    w = llama(db, 1, batch, seq, d_model, heads, head_dim, d_ff, eps, materialize=materialize,
              seed=seed, prefix=prefix)
    return Workload("llama_block", w.output, w.arrays, w.reference_fn, w.params)
