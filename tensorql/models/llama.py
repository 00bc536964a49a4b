"""A whole LLaMA decoder (Hugging Face ``transformers`` layout) as tensorql queries.

:class:`Llama` takes a ``LlamaForCausalLM``'s config and ``state_dict()`` (or a safetensors
file), stores every weight in the session's chunk store under ``prefix``, and builds token
embedding, RMSNorm, rotary embeddings, grouped-query attention with a causal mask, SwiGLU and
the LM head as extended einsums. :meth:`Llama.logits` is one lazy query (it has an EXPLAIN and
runs under the session's ``memory_limit``; token embeddings are gathered rows of the table,
or a one-hot join under a limit); :meth:`Llama.step` runs tokens after a :class:`KVCache`
(per layer one query for its keys/values and one for its output) and
:meth:`Llama.generate` decodes greedily: the prompt by ``step``, then every new token by one
run of a :class:`Decoder`'s cached plan over a static cache.

Grouped-query attention needs no copies of the key heads: query head ``h = k * G + g`` (as
transformers' ``repeat_kv`` orders them) carries labels ``k`` (its key/value head) and ``g``.

>>> import numpy as np, tensorql as tq
>>> shape = LlamaShape(vocab=11, d_model=8, d_ff=12, layers=1, heads=2, kv_heads=1,
...                    head_dim=4)
>>> model = Llama.random(tq.connect(), shape, seed=0)
>>> model.logits([[1, 2, 3]]).shape
(1, 3, 11)
>>> len(model.generate([1, 2, 3], max_new_tokens=4))
7
"""

from __future__ import annotations

import functools
import math
import numbers
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from tensorql.api.einsum import einsum
from tensorql.api.tensor import Tensor
from tensorql.einsum.graph import Constant, substitute_many
from tensorql.errors import ShapeError
from tensorql.grid import ChunkGrid, auto_tile
from tensorql.models.workloads import rms_norm

MASK_VALUE = -1e9
PROMPT_BLOCK_ROWS = 128  # the fewest positions a block of a prompt is cut into
# a weight of at most this many elements is stored as one chunk (see Llama.from_weights)
WHOLE_WEIGHT_MAX_ELEMS = 1 << 22


@dataclass(frozen=True)
class LlamaShape:
    """The sizes of a LLaMA model (what a ``LlamaConfig`` says, under plain names)."""

    vocab: int
    d_model: int
    d_ff: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    eps: float = 1e-6
    tied: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab", "d_model", "d_ff", "heads", "kv_heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ShapeError(f"LlamaShape.{name} must be a positive integer, got {value!r}")
        layers = self.layers
        if isinstance(layers, bool) or not isinstance(layers, numbers.Integral) or layers < 0:
            raise ShapeError(f"LlamaShape.layers must be an integer >= 0, got {layers!r}")
        if self.heads % self.kv_heads:
            raise ShapeError(f"LlamaShape: {self.heads} query heads do not share "
                             f"{self.kv_heads} key/value heads evenly")

    @property
    def groups(self) -> int:
        """Query heads per key/value head."""
        return self.heads // self.kv_heads

    @classmethod
    def from_config(cls, config: Any) -> LlamaShape:
        """From a ``transformers.LlamaConfig`` (default rotary embeddings only) or a mapping of
        its fields (``config.to_dict()``). A config of another model (``model_type`` other than
        ``llama``; Mistral only without a sliding window, where it is the same model) is
        refused, as is every option this model does not compute.

        >>> LlamaShape.from_config({"model_type": "qwen2"})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        tensorql.errors.ShapeError: model_type 'qwen2' is not supported (only 'llama', ...)
        """
        if isinstance(config, Mapping):
            config = SimpleNamespace(**config)
        model_type = getattr(config, "model_type", None)
        sliding = getattr(config, "sliding_window", None)
        if model_type not in (None, "llama", "mistral") or (model_type == "mistral"
                                                            and sliding is not None):
            raise ShapeError(f"model_type {model_type!r} is not supported (only 'llama', and "
                             "'mistral' without sliding_window)")
        if sliding is not None and getattr(config, "use_sliding_window", True):
            raise ShapeError(f"sliding_window {sliding!r} is not supported (full attention "
                             "only)")
        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling",
                                                                   None) or {}
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            raise ShapeError(f"rope_type {kind!r} is not supported (only 'default')")
        theta = rope.get("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
        if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
            raise ShapeError("LLaMA configs with attention_bias or mlp_bias are not supported")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ShapeError(f"hidden_act {config.hidden_act!r} is not supported (only silu)")
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(vocab=config.vocab_size, d_model=config.hidden_size,
                   d_ff=config.intermediate_size, layers=config.num_hidden_layers,
                   heads=heads, kv_heads=kv_heads, head_dim=head_dim, rope_theta=float(theta),
                   eps=float(config.rms_norm_eps),
                   tied=bool(getattr(config, "tie_word_embeddings", False)))

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every stored weight's name and shape (transformers' layout, heads split out)."""
        kv, g, e, d, f = self.kv_heads, self.groups, self.head_dim, self.d_model, self.d_ff
        shapes: dict[str, tuple[int, ...]] = {"embed": (self.vocab, d), "norm": (d,)}
        for n in range(self.layers):
            shapes.update({
                f"l{n}_attn_norm": (d,), f"l{n}_wq": (kv, g, e, d), f"l{n}_wkv": (2, kv, e, d),
                f"l{n}_wo": (d, kv, g, e), f"l{n}_mlp_norm": (d,), f"l{n}_gate": (f, d),
                f"l{n}_up": (f, d), f"l{n}_down": (d, f),
            })
        if not self.tied:
            shapes["lm_head"] = (self.vocab, d)
        return shapes


def _hf_weights(shape: LlamaShape, state: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """transformers' ``state_dict`` names -> this module's names, heads split, K/V stacked."""
    used: set[str] = set()

    def take(name: str, want: tuple[int, ...] | None = None) -> np.ndarray:
        keys = [key for key in (name, f"model.{name}") if key in state]
        if not keys:
            raise ShapeError(f"state_dict has no weight {name!r}")
        used.update(keys)
        value = state[keys[0]]
        if isinstance(value, torch.Tensor):
            value = value.detach().to(torch.float32).cpu().numpy()
        value = np.asarray(value, dtype=np.float32)
        if want is not None and value.shape != want:  # before it is split into heads
            raise ShapeError(f"weight {name!r} has shape {value.shape}, expected {want}")
        return value

    kv, g, e, d = shape.kv_heads, shape.groups, shape.head_dim, shape.d_model
    out = {"embed": take("embed_tokens.weight"), "norm": take("norm.weight")}
    for n in range(shape.layers):
        p = f"layers.{n}."
        out[f"l{n}_attn_norm"] = take(p + "input_layernorm.weight")
        out[f"l{n}_wq"] = take(p + "self_attn.q_proj.weight", (kv * g * e, d)).reshape(kv, g, e, d)
        out[f"l{n}_wkv"] = np.stack([
            take(p + "self_attn.k_proj.weight", (kv * e, d)).reshape(kv, e, d),
            take(p + "self_attn.v_proj.weight", (kv * e, d)).reshape(kv, e, d)])
        out[f"l{n}_wo"] = take(p + "self_attn.o_proj.weight", (d, kv * g * e)).reshape(d, kv, g, e)
        out[f"l{n}_mlp_norm"] = take(p + "post_attention_layernorm.weight")
        out[f"l{n}_gate"] = take(p + "mlp.gate_proj.weight")
        out[f"l{n}_up"] = take(p + "mlp.up_proj.weight")
        out[f"l{n}_down"] = take(p + "mlp.down_proj.weight")
    if not shape.tied:
        out["lm_head"] = take("lm_head.weight")
    # a weight left over is a part of the model this one would not compute (a bias, a norm of
    # another architecture, a layer more than the config's): refused, not dropped. Tied
    # models' state dicts carry lm_head.weight (the embedding again); rotary tables are
    # computed here.
    unused = sorted(key for key in state if key not in used and not (
        key.endswith("rotary_emb.inv_freq") or (shape.tied and key == "lm_head.weight")))
    if unused:
        more = f" and {len(unused) - 5} more" if len(unused) > 5 else ""
        raise ShapeError(f"state_dict has weights this LLaMA does not use: "
                         f"{', '.join(map(repr, unused[:5]))}{more} (another architecture, or "
                         "a config without the option they belong to)")
    for name, want in shape.weight_shapes().items():
        if out[name].shape != want:
            raise ShapeError(f"weight {name!r} has shape {out[name].shape}, expected {want}")
    return out


def rope_tables(shape: LlamaShape, positions: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of every (position, head-dim) pair, as transformers computes them.

    >>> cos, sin = rope_tables(LlamaShape(5, 4, 4, 1, 1, 1, 4), [0, 1])
    >>> cos.shape, float(cos[0, 0]), float(sin[0, 0])
    ((2, 4), 1.0, 0.0)
    """
    e = shape.head_dim
    # in torch's float32 ops, as transformers writes them: numpy's float32 power rounds some
    # frequencies one ulp apart, an angle error that grows with the position (1e-4 in cos at
    # position 4096, head_dim 128)
    inv = 1.0 / (shape.rope_theta ** (torch.arange(0, e, 2, dtype=torch.float) / e))
    freqs = torch.as_tensor(np.asarray(positions), dtype=torch.float)[:, None] * inv
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().numpy(), angles.sin().numpy()


def query_rope_tables(shape: LlamaShape,
                      tables: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """:func:`rope_tables` ``tables`` times 1/sqrt(head_dim): the queries' rotation with the
    scores' scale folded in (the S x T scores a head are then not scaled in a pass of their
    own, and the tables are scaled here, once, not by a step of every run).

    >>> shape = LlamaShape(5, 4, 4, 1, 1, 1, 4)
    >>> cos, sin = query_rope_tables(shape, rope_tables(shape, [0, 1]))
    >>> float(cos[0, 0]), float(sin[0, 0])
    (0.5, 0.0)
    """
    scale = np.float32(1.0 / math.sqrt(shape.head_dim))
    return tables[0] * scale, tables[1] * scale


def _rotate_half_matrix(e: int) -> np.ndarray:
    """R with ``x @ R == rotate_half(x) == cat(-x[half:], x[:half])``."""
    half = e // 2
    rot = np.zeros((e, e), dtype=np.float32)
    for j in range(half):
        rot[j + half, j] = -1.0
        rot[j, j + half] = 1.0
    return rot


def rotation_matrix(cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """The rotary embedding of one position as a matrix: ``x @ M == x * cos + rotate_half(x)
    * sin`` for ``cos`` and ``sin`` of shape (E,), i.e. ``M = diag(cos) + R * sin`` with R
    :func:`_rotate_half_matrix`'s. A decoded token rotates its queries and keys by ONE
    product with it (E x E a head, built on the host each token) where the tables took a
    product with R, a product of R with the sine table and a join with each table.

    >>> cos, sin = rope_tables(LlamaShape(5, 4, 4, 1, 1, 1, 4), [3])
    >>> x = np.arange(4, dtype=np.float32)
    >>> bool(np.allclose(x @ rotation_matrix(cos[0], sin[0]),
    ...                  x * cos[0] + x @ _rotate_half_matrix(4) * sin[0], atol=1e-6))
    True
    """
    rot = _rotate_half_matrix(cos.shape[-1]) * sin[None, :]
    rot[np.diag_indices_from(rot)] += cos
    return rot.astype(np.float32)


@dataclass(frozen=True)
class KVCache:
    """Keys (rotated) and values of every earlier position, per layer: (2, B, T, KV, E)."""

    layers: tuple[torch.Tensor, ...]

    @property
    def length(self) -> int:
        return int(self.layers[0].shape[2]) if self.layers else 0

    def extend(self, new: Sequence[torch.Tensor]) -> KVCache:
        return KVCache(tuple(torch.cat([old, add], dim=2) for old, add in zip(self.layers, new))
                       if self.layers else tuple(new))


class Llama:
    """A LLaMA model whose weights live in a tensorql session (see the module docstring)."""

    def __init__(self, db: Any, shape: LlamaShape, prefix: str = "llama_") -> None:
        self.db = db
        self.shape = shape
        self.prefix = prefix
        # generate()'s decoder, kept for the next call: (max_length, the store's generation,
        # the session's options, the decoder) -- see _generation_decoder
        self._kept_decoder: tuple[int, int, Any, Decoder] | None = None
        # generate()'s prompt query, kept likewise: ((batch, seq), generation, options, query)
        self._kept_prompt: tuple[tuple[int, int], int, Any, PromptQuery] | None = None
        # a prompt's rotary tables and causal mask by its positions (see _prompt_tables)
        self._prompt_memo: tuple[tuple[int, ...], Any] | None = None
        # the plan of the last prefill planned from its expression, for other lengths
        self._prefill_template: _PrefillTemplate | None = None
        # prefills with a plan of their own, by (batch, seq), while something else holds
        # them (the template's is held by it): a shorter prompt may run in one, padded
        self._planned_prefills: weakref.WeakValueDictionary[tuple[int, int], Prefill] = \
            weakref.WeakValueDictionary()
        self._replan_seconds: float | None = None  # the last re-bind of a prefill's plan
        wanted = shape.weight_shapes()
        self.weights = {name: db.tensor(prefix + name) for name in wanted}
        for name, want in wanted.items():
            if tuple(self.weights[name].shape) != want:
                raise ShapeError(f"stored weight {prefix + name!r} is "
                                 f"{tuple(self.weights[name].shape)} where this LlamaShape "
                                 f"wants {want}: the shape is not the stored model's")
        self._kept_lock = threading.Lock()  # takes and puts back the kept decoder
        self._rot = db.constant(_rotate_half_matrix(shape.head_dim))
        # one-hot picks of the keys (p = 0) and the values (p = 1) of a stacked (2, ...) pair
        self._pick = (db.constant(np.array([1.0, 0.0], dtype=np.float32)),
                      db.constant(np.array([0.0, 1.0], dtype=np.float32)))

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_weights(cls, db: Any, shape: LlamaShape, weights: Mapping[str, np.ndarray],
                     prefix: str = "llama_") -> Llama:
        """Store ``weights`` (this module's names) in ``db`` and build the model over them.
        A weight of at most :data:`WHOLE_WEIGHT_MAX_ELEMS` elements is stored as one chunk
        (the automatic tiles cut at about a million): a prompt's product with it is then one
        task per block of positions, over the whole weight -- the bench model's SwiGLU
        weights, 2048 x 768, were cut in two, so their products ran at N = 1024 (oneDNN's
        packed product, one thread, 256 x 768 x N: 72.6 GFLOP/s against 76.6 at N = 2048)
        and the down projection's two halves accumulated into one output chunk. Larger
        weights (an LM head) keep the automatic tiles, whose chunks the workers share."""
        for name in shape.weight_shapes():
            array = np.ascontiguousarray(weights[name])
            tile = array.shape if array.size <= WHOLE_WEIGHT_MAX_ELEMS else None
            db.from_numpy(prefix + name, array, tile=tile, replace=True)
        return cls(db, shape, prefix)

    @classmethod
    def from_transformers(cls, db: Any, model: Any, prefix: str = "llama_") -> Llama:
        """From a ``transformers.LlamaForCausalLM`` (its ``config`` and ``state_dict()``)."""
        return cls.from_state_dict(db, model.config, model.state_dict(), prefix)

    @classmethod
    def from_state_dict(cls, db: Any, config: Any, state: Mapping[str, Any],
                        prefix: str = "llama_") -> Llama:
        """From a ``LlamaConfig`` and a state dict in transformers' names."""
        shape = LlamaShape.from_config(config)
        return cls.from_weights(db, shape, _hf_weights(shape, state), prefix)

    @classmethod
    def from_safetensors(cls, db: Any, config: Any, path: str,
                         prefix: str = "llama_") -> Llama:
        """From a ``LlamaConfig`` and a safetensors file of the model's weights."""
        from safetensors.torch import load_file  # bfloat16 too (numpy has no such type)

        return cls.from_state_dict(db, config, load_file(path), prefix)

    @classmethod
    def random(cls, db: Any, shape: LlamaShape, seed: int = 0,
               prefix: str = "llama_") -> Llama:
        """Random weights (normal, std 0.02; norms at 1), seeded."""
        rng = np.random.default_rng(seed)
        weights = {name: (np.ones(dims, np.float32) if name.endswith("norm") else
                          (rng.standard_normal(dims) * 0.02).astype(np.float32))
                   for name, dims in shape.weight_shapes().items()}
        return cls.from_weights(db, shape, weights, prefix)

    # ---- the pieces, as lazy einsums ----------------------------------------------------
    def _w(self, name: str) -> Tensor:
        return self.weights[name]

    def _rmsnorm(self, x: Tensor, gain: str) -> Tensor:
        return rms_norm(x, self._w(gain), self.shape.eps)

    def embed(self, tokens: np.ndarray) -> Tensor:
        """Token embeddings (B, S, D): the table's rows gathered by token id, as a constant of
        the query. (As an einsum the lookup is a one-hot (B, S, V) matrix joined with the
        table: V x D multiply-adds per token -- 12.6 GFLOP for 512 tokens of a 32000-word
        vocabulary -- where a gather reads one row; see :meth:`embed_onehot`.) The table is
        read from the store once and kept until the stored tensors change. Under a
        ``memory_limit`` the one-hot join is used instead, so that the table streams through
        the device budget like every weight rather than sitting in memory beside it."""
        if self.db.options.memory_limit is not None:
            return self.embed_onehot(tokens)
        table = self.embedding_table()
        hidden = table[torch.from_numpy(np.asarray(tokens, dtype=np.int64))]
        return self.db.constant(hidden, tile=self._prompt_tile(hidden.shape))

    def embed_onehot(self, tokens: np.ndarray) -> Tensor:
        """The same embeddings as one einsum: one-hot tokens joined with the stored table."""
        onehot = np.zeros((*tokens.shape, self.shape.vocab), dtype=np.float32)
        np.put_along_axis(onehot, tokens[..., None], 1.0, axis=-1)
        # the table first: its chunk tiles are kept (the small one-hot is retiled to them)
        return einsum("vd,bsv->bsd", self._w("embed"),
                      self.db.constant(onehot, tile=self._prompt_tile(onehot.shape)))

    def _prompt_tile(self, shape: Sequence[int]) -> tuple[int, ...]:
        """Tiles for a prompt's (B, S, ...) input: the automatic ones, with the positions cut
        into one block per lane (``Options.task_lanes``: a CPU's workers, a GPU's compute
        streams; of at least ``PROMPT_BLOCK_ROWS`` rows) -- every
        projection, norm and attention of the prompt then runs as that many tasks that the
        workers take side by side, where one task a step left a worker idle (512 tokens of
        the bench model: ~8% faster on 2 workers).

        >>> import tensorql as tq
        >>> shape = LlamaShape(vocab=11, d_model=8, d_ff=12, layers=1, heads=2, kv_heads=1,
        ...                    head_dim=4)
        >>> model = Llama.random(tq.connect(workers=2), shape, seed=0)
        >>> model._prompt_tile((1, 512, 8)), model._prompt_tile((1, 100, 8))
        ((1, 256, 8), (1, 100, 8))
        """
        tile = list(auto_tile(shape, self.db.options.tile_target_elems))
        blocks = min(self.db.options.task_lanes, shape[1] // PROMPT_BLOCK_ROWS)
        if blocks > 1:
            tile[1] = min(tile[1], -(-shape[1] // blocks))
        return tuple(tile)

    def embedding_table(self) -> torch.Tensor:
        """The embedding table in memory (read once per generation of the store; not to be
        written: see :meth:`_stored`)."""
        generation = getattr(self, "_table_generation", None)
        if generation != self.db.generation:
            self._table = self._stored("embed")
            self._table_generation = self.db.generation
        return self._table

    def _stored(self, name: str) -> torch.Tensor:
        """Weight ``name`` (a key of :attr:`weights`) whole, as the store holds it: a stored
        chunk or region straight from its chunk cache (no query, no copy; the cache's own
        tensor, so never written).

        >>> import tensorql as tq
        >>> shape = LlamaShape(vocab=11, d_model=8, d_ff=12, layers=1, heads=2, kv_heads=1,
        ...                    head_dim=4)
        >>> model = Llama.random(tq.connect(), shape, seed=0)
        >>> torch.equal(model._stored("l0_up"), model.weights["l0_up"].torch())
        True
        """
        weight = self.weights[name]
        return self.db.chunk_store.read_region(weight.node.name, [0] * len(weight.shape),
                                               list(weight.shape))

    def keys_values(self, x: Tensor, layer: int, positions: Sequence[int]) -> Tensor:
        """Layer ``layer``'s rotated keys and values of hidden states ``x``: (2, B, S, KV, E)."""
        cos, sin = rope_tables(self.shape, positions)
        # rotary embedding on the keys (p = 0) only: values get cos = 1, sin = 0
        cos_p = self.db.constant(np.stack([cos, np.ones_like(cos)]))
        sin_p = self.db.constant(np.stack([sin, np.zeros_like(sin)]))
        return self._keys_values(self._rmsnorm(x, f"l{layer}_attn_norm"), layer, cos_p, sin_p)

    def _keys_values(self, xn: Tensor, layer: int, cos_p: Tensor, sin_p: Tensor) -> Tensor:
        """:meth:`keys_values` of the normed hidden states ``xn``, with the rotary tables
        given as (2, S, E) tensors (keys, then values with cos 1 and sin 0)."""
        kv = einsum("bsd,pked->pbske", xn, self._w(f"l{layer}_wkv"))
        return (einsum("pbske,pse->pbske", kv, cos_p)
                + einsum("pbske,ef,psf->pbskf", kv, self._rot, sin_p))

    def block(self, x: Tensor, layer: int, positions: Sequence[int],
              kv: Tensor | None = None) -> Tensor:
        """Decoder block ``layer`` on hidden states ``x`` (B, S, D) at ``positions``, attending
        to keys/values ``kv`` (2, B, T, KV, E) of positions 0..T-1 (causal) -- by default the
        prompt's own, positions 0..S-1 (``positions`` then being those)."""
        if kv is None:
            return self._prompt_block(x, layer, positions)[0]
        tables = rope_tables(self.shape, positions)
        cos, sin = (self.db.constant(t) for t in query_rope_tables(self.shape, tables))
        xn = self._rmsnorm(x, f"l{layer}_attn_norm")
        keys = einsum("pbtke,p->btke", kv, self._pick[0])
        values = einsum("pbtke,p->btke", kv, self._pick[1])
        total = keys.shape[1]
        mask = np.where(np.arange(total)[None, :] > np.asarray(positions)[:, None],
                        np.float32(MASK_VALUE), np.float32(0.0)).astype(np.float32)
        return self._block(x, xn, layer, cos, sin,
                           self.db.constant(mask) if mask.any() else None, keys, values)

    def _prompt_block(self, x: Tensor, layer: int,
                      positions: Sequence[int]) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`block` of a prompt attending to itself, and its rotated keys and its
        values (B, S, KV, E)."""
        tables, query_tables, mask = self._prompt_tables(positions)
        cos, sin = (self.db.constant(t) for t in query_tables)
        xn = self._rmsnorm(x, f"l{layer}_attn_norm")
        keys, values = self._own_keys_values(xn, layer, tables)
        out = self._block(x, xn, layer, cos, sin,
                          self.db.constant(mask) if mask is not None else None, keys, values)
        return out, keys, values

    def _prompt_tables(self, positions: Sequence[int]) -> tuple[
            tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray], np.ndarray | None]:
        """The rotary tables, the queries' (scaled) ones and the causal mask (None: nothing
        masked) of a prompt at ``positions`` attending to itself -- the same for every layer,
        so made once for the last positions asked (~1 ms a layer for 512 positions)."""
        key = tuple(int(p) for p in positions)
        memo = self._prompt_memo
        if memo is None or memo[0] != key:
            tables = rope_tables(self.shape, key)
            where = np.asarray(key)
            mask = np.where(np.arange(len(key))[None, :] > where[:, None],
                            np.float32(MASK_VALUE), np.float32(0.0)).astype(np.float32)
            memo = (key, (tables, query_rope_tables(self.shape, tables),
                          mask if mask.any() else None))
            self._prompt_memo = memo
        return memo[1]

    def _own_keys_values(self, xn: Tensor, layer: int,
                         tables: tuple[np.ndarray, np.ndarray]) -> tuple[Tensor, Tensor]:
        """The rotated keys and the values (B, S, KV, E) of the normed hidden states ``xn``
        (rotary ``tables`` of their positions), each its own product with its half of the
        stacked weight (read as a region of it): no stacked (2, ...) result to pick them out
        of again, and no rotation of the values."""
        cos, sin = (self.db.constant(t) for t in tables)
        weight = self._w(f"l{layer}_wkv")  # (2, KV, E, D): p = 0 the keys', 1 the values'
        k = einsum("bsd,pked->bske", xn, weight[0:1])
        keys = einsum("bske,se->bske", k, cos) + einsum("bske,ef,sf->bskf", k, self._rot, sin)
        return keys, einsum("bsd,pked->bske", xn, weight[1:2])

    def _block(self, x: Tensor, xn: Tensor, layer: int, cos: Tensor, sin: Tensor,
               mask: Tensor | None, keys: Tensor, values: Tensor) -> Tensor:
        """:meth:`block` with the normed ``x`` (``xn``), the queries' rotary tables (S, E)
        (:func:`query_rope_tables`), the additive mask (S, T) and the keys and values
        (B, T, KV, E) given."""
        q = self._queries(xn, layer, cos, sin)
        scores = einsum("bskge,btke->bkgst", q, keys)
        if mask is not None:
            scores = scores + mask
        probs = scores.softmax(-1)
        return self._rest_of_block(x, layer, einsum("bkgst,btke->bskge", probs, values))

    def _decode_block(self, x: Tensor, xn: Tensor, layer: int, rotation: Tensor,
                      mask: Tensor, cached: tuple[Tensor, Tensor], new: Tensor,
                      place: Tensor) -> Tensor:
        """:meth:`_block` for one new token attending to a static cache: ``cached`` keys and
        values (B, T, KV, E), zero at the token's position ``place`` (a one-hot (1, T)) and
        masked beyond it, and the token's own keys/values ``new`` (B, 1, 2, KV, E). Its own
        score goes into the scores at ``place`` and its value is weighted by the probability
        there: the cache is read once, by the two products with it, where joining ``new``
        into a copy of the cache first made four more passes over it a layer. The queries
        are rotated (and scaled) by one product with ``rotation`` (E, E): the token's
        :func:`rotation_matrix` times 1/sqrt(head_dim)."""
        q = einsum("bskge,ef->bskgf",
                   einsum("bsd,kged->bskge", xn, self._w(f"l{layer}_wq")), rotation)
        keys, values = cached
        own = einsum("bskge,bspke,p->bkgs", q, new, self._pick[0])
        scores = (einsum("bskge,btke->bkgst", q, keys) + einsum("bkgs,st->bkgst", own, place)
                  + mask)
        probs = scores.softmax(-1)
        attn = (einsum("bkgst,btke->bskge", probs, values)
                + einsum("bkgst,st,bspke,p->bskge", probs, place, new, self._pick[1]))
        return self._rest_of_block(x, layer, attn)

    def _queries(self, xn: Tensor, layer: int, cos: Tensor, sin: Tensor) -> Tensor:
        """Layer ``layer``'s rotated queries (B, S, KV, G, E) of the normed hidden states
        ``xn``, scaled by 1/sqrt(head_dim): ``cos`` and ``sin`` are the queries' tables
        (:func:`query_rope_tables`), the scale folded in."""
        q = einsum("bsd,kged->bskge", xn, self._w(f"l{layer}_wq"))
        return einsum("bskge,se->bskge", q, cos) + einsum("bskge,ef,sf->bskgf", q, self._rot,
                                                          sin)

    def _rest_of_block(self, x: Tensor, layer: int, attn: Tensor) -> Tensor:
        """The block after attention: output projection, residual, RMSNorm, SwiGLU MLP,
        residual."""
        n = f"l{layer}_"
        h = x + einsum("bskge,dkge->bsd", attn, self._w(n + "wo"))
        hn = self._rmsnorm(h, n + "mlp_norm")
        gate = einsum("bsd,fd->bsf", hn, self._w(n + "gate")).silu()
        up = einsum("bsd,fd->bsf", hn, self._w(n + "up"))
        return h + einsum("bsf,bsf,df->bsd", gate, up, self._w(n + "down"))

    def head(self, x: Tensor) -> Tensor:
        """Final RMSNorm and LM head: logits (B, S, V)."""
        table = self._w("embed") if self.shape.tied else self._w("lm_head")
        return einsum("bsd,vd->bsv", self._rmsnorm(x, "norm"), table)

    # ---- queries ------------------------------------------------------------------------
    def logits(self, tokens: Any) -> Tensor:
        """The logits (B, S, V) of token ids ``tokens`` (B, S), as one lazy query."""
        ids = self._tokens(tokens)
        positions = list(range(ids.shape[1]))
        x = self.embed(ids)
        for layer in range(self.shape.layers):
            x = self.block(x, layer, positions)
        return self.head(x)

    def prefill(self, batch: int, seq: int, pad: bool = True) -> Prefill:
        """Logits of prompts of shape (``batch``, ``seq``), one query planned once for all of
        them (see :class:`Prefill`); ``pad``: whether a prompt may run in the plan of a
        longer prefill, padded at its end, where that costs less than planning its own."""
        return Prefill(self, batch, seq, pad=pad)

    def _padding_host(self, prefill: Prefill, stamp: tuple) -> Prefill | None:
        """The planned prefill ``prefill``'s prompts may run in, padded at the end (see
        :class:`Prefill`), or None: of the same batch and longer, planned under ``stamp``
        and run once (its time known), and the run of its extra positions -- its last run's
        time pro rata -- estimated below the last re-bind of a plan (none measured yet:
        None). The shortest such prefill."""
        replan = self._replan_seconds
        if replan is None:
            return None
        template = self._prefill_template
        candidates = list(self._planned_prefills.values())
        if template is not None:
            candidates.append(template.prefill)
        best = None
        for host in candidates:
            seconds = host.run_seconds
            if (host.batch != prefill.batch or host.seq <= prefill.seq or seconds is None
                    or host._kept is None or host._kept[0] != stamp):
                continue
            if (host.seq - prefill.seq) / host.seq * seconds < replan \
                    and (best is None or host.seq < best.seq):
                best = host
        return best

    def step(self, tokens: Any, cache: KVCache) -> tuple[torch.Tensor, KVCache]:
        """Run ``tokens`` (B, S) after the ``cache``'s positions: last-position logits (B, V)
        and the cache extended by these tokens. Two queries per layer, one for the head."""
        ids = self._tokens(tokens)
        self._check_cache(cache, ids.shape[0])
        start = cache.length
        positions = list(range(start, start + ids.shape[1]))
        x = self.embed(ids).torch()
        new = []
        for layer in range(self.shape.layers):
            hidden = self.db.constant(x)
            kv = self.keys_values(hidden, layer, positions).torch()
            new.append(kv)
            past = cache.layers[layer] if cache.layers else None
            everything = kv if past is None else torch.cat([past, kv], dim=2)
            x = self.block(hidden, layer, positions, self.db.constant(everything)).torch()
        last = self.db.constant(x[:, -1:, :])
        return self.head(last).torch()[:, 0, :], cache.extend(new)

    def decoder(self, cache: KVCache, max_length: int) -> Decoder:
        """A one-token-at-a-time decoder continuing after ``cache`` (a prefill's), for up to
        ``max_length`` positions in all: one planned query per token (see :class:`Decoder`)."""
        return Decoder(self, cache, max_length)

    def generate(self, tokens: Iterable[int], max_new_tokens: int) -> list[int]:
        """Greedy decoding with a KV cache: the prompt (one query per layer pair, see
        :meth:`step`), then ``max_new_tokens`` new tokens, each one run of the
        :class:`Decoder`'s cached plan. The decoder is kept for the next call: a call of the
        same prompt length and ``max_new_tokens`` (as a server's requests) restarts it on its
        prompt (:meth:`Decoder.restart`) instead of planning one and laying its weights out
        again (see :meth:`_generation_decoder`)."""
        ids = self._tokens(list(tokens) if not isinstance(tokens, (np.ndarray, torch.Tensor))
                           else tokens)
        if ids.shape[0] != 1:
            raise ShapeError(f"generate takes one prompt (a list of token ids), got a batch "
                             f"of {ids.shape[0]}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) \
                or max_new_tokens < 0:
            raise ShapeError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
        prompt = [int(t) for t in ids[0]]
        out = list(prompt)
        logits, cache = self._prompt_query(1, len(prompt)).run([prompt])
        decoder = None
        try:
            for _ in range(max_new_tokens):
                token = int(torch.argmax(logits[0]))
                out.append(token)
                if len(out) == len(prompt) + max_new_tokens:
                    break
                if self.shape.layers == 0:  # no attention: a token's logits are its own
                    logits = self.step([[token]], KVCache(()))[0]
                    continue
                if decoder is None:
                    decoder = self._generation_decoder(cache, len(prompt) + max_new_tokens)
                logits = decoder.step([[token]])
        finally:
            if decoder is not None:  # back for the next call (taken while in use)
                with self._kept_lock:
                    self._kept_decoder = (decoder.max_length, self.db.generation,
                                          self.db.options, decoder)
        return out

    def _prompt_query(self, batch: int, seq: int) -> PromptQuery:
        """The :class:`PromptQuery` of prompts of shape (``batch``, ``seq``): the last one's
        when it has that shape and the stored tensors and options are those it was planned
        under, else a new one (then kept)."""
        kept = self._kept_prompt
        if kept is not None:
            shape, generation, options, query = kept
            if (shape == (batch, seq) and generation == self.db.generation
                    and options == self.db.options):
                return query
        query = PromptQuery(self, batch, seq)
        self._kept_prompt = ((batch, seq), self.db.generation, self.db.options, query)
        return query

    def _generation_decoder(self, cache: KVCache, max_length: int) -> Decoder:
        """The decoder of a :meth:`generate` call: the previous call's, restarted on
        ``cache``, when it has the same batch and ``max_length`` and the stored tensors and
        the session's options are those it was planned under; else a new one. One is kept
        (its plan, its cache buffers and, without a ``memory_limit``, its copy of the
        weights laid out for one-row products, as while it decodes); it is taken out while
        a call uses it, so a concurrent call builds its own."""
        with self._kept_lock:
            kept, self._kept_decoder = self._kept_decoder, None
        if kept is not None:
            length, generation, options, decoder = kept
            if (length == max_length and generation == self.db.generation
                    and options == self.db.options and decoder.batch == cache.layers[0].shape[1]):
                decoder.restart(cache)
                return decoder
        return self.decoder(cache, max_length)

    def _check_cache(self, cache: KVCache, batch: int | None = None) -> None:
        """ShapeError unless ``cache`` (none, or every layer's) is of this model -- its
        layer count, key/value heads and head dim -- with one batch and length throughout,
        ``batch`` prompts where given."""
        if not isinstance(cache, KVCache):
            raise ShapeError(f"a KVCache is needed, got {type(cache).__name__}")
        if not cache.layers:
            return
        s = self.shape
        if len(cache.layers) != s.layers:
            raise ShapeError(f"the KVCache has {len(cache.layers)} layers, this model "
                             f"{s.layers}: it is another model's")
        first = tuple(cache.layers[0].shape)
        for n, layer in enumerate(cache.layers):
            got = tuple(layer.shape)
            if (len(got) != 5 or got[0] != 2 or got[3:] != (s.kv_heads, s.head_dim)
                    or got[1:3] != first[1:3]):
                raise ShapeError(f"KVCache layer {n} is {got}, where this model's are (2, "
                                 f"batch, positions, {s.kv_heads}, {s.head_dim}) alike")
        if batch is not None and first[1] != batch:
            raise ShapeError(f"the KVCache holds {first[1]} prompts, the tokens {batch}")

    def _tokens(self, tokens: Any) -> np.ndarray:
        try:
            ids = np.asarray(tokens.cpu() if isinstance(tokens, torch.Tensor) else tokens)
        except ValueError:  # ragged rows
            raise ShapeError("token ids must be a (batch, seq) integer array; the rows given "
                             "are of different lengths") from None
        if ids.ndim == 1:
            ids = ids[None, :]
        if ids.ndim != 2 or ids.shape[1] == 0 or not np.issubdtype(ids.dtype, np.integer):
            raise ShapeError(f"token ids must be a non-empty (batch, seq) integer array, got "
                             f"shape {ids.shape} of {ids.dtype}")
        bad = ids[(ids < 0) | (ids >= self.shape.vocab)]
        if bad.size:
            raise ShapeError(f"token id {int(bad[0])} outside the vocabulary "
                             f"0..{self.shape.vocab - 1}")
        return ids.astype(np.int64)


class _TokenEmbeddings:
    """The embeddings of a (batch, seq) block of token ids as an input of a query planned
    once (:class:`Prefill`, :class:`Decoder`): a constant written in place for each block --
    the table's rows gathered (a gather, not a one-hot product over the whole vocabulary) --
    or, under a ``memory_limit``, a one-hot constant joined with the stored table, so the
    table streams through the budget like every weight."""

    def __init__(self, model: Llama, batch: int, seq: int) -> None:
        db = model.db
        limited = db.options.memory_limit is not None
        self.onehot = torch.zeros((batch, seq, model.shape.vocab)) if limited else None
        self.hidden = None if limited else torch.zeros(
            (batch, seq, model.shape.d_model), dtype=model.embedding_table().dtype)
        value = self.onehot if limited else self.hidden
        constant = db.constant(value, tile=model._prompt_tile(value.shape))
        self.constant = constant  # the constant written in place
        self.tensor = einsum("vd,bsv->bsd", model._w("embed"), constant) if limited else constant

    def write(self, ids: np.ndarray, table: Callable[[], torch.Tensor]) -> None:
        """Put the embeddings of ``ids`` (batch, seq) in place; ``table()`` gives the
        embedding table when the rows are gathered. Done on this thread alone
        (:func:`~tensorql.exec.threads.one_torch_thread`): the query that reads them starts
        next, and a second thread of this write would spin beside its workers."""
        from tensorql.exec.threads import one_torch_thread

        with one_torch_thread():
            if self.hidden is not None:  # gathered straight into place (no indexed copy)
                rows = torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64)).reshape(-1)
                torch.index_select(table(), 0, rows,
                                   out=self.hidden.view(-1, self.hidden.shape[-1]))
            else:
                self.onehot.zero_()
                self.onehot.scatter_(2, torch.from_numpy(ids)[..., None], 1.0)


class _PromptOfShape:
    """What :class:`Prefill` and :class:`PromptQuery` share: a prompt shape (batch, seq)
    checked once, the token embeddings written in place for each prompt, and the check of a
    prompt's ids against the shape.

    >>> import tensorql as tq
    >>> shape = LlamaShape(vocab=11, d_model=8, d_ff=12, layers=1, heads=2, kv_heads=1,
    ...                    head_dim=4)
    >>> prompt = _PromptOfShape(Llama.random(tq.connect(), shape, seed=0), 1, 3, "prefill")
    >>> prompt._embed([[1, 2, 3]]).shape
    (1, 3)
    """

    def __init__(self, model: Llama, batch: int, seq: int, what: str) -> None:
        if any(isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1
               for n in (batch, seq)):
            raise ShapeError(f"a prompt shape needs integers batch and seq >= 1, got "
                             f"({batch!r}, {seq!r})")
        self.model, self.batch, self.seq, self._what = model, int(batch), int(seq), what
        self.positions = list(range(self.seq))

    @functools.cached_property
    def embeddings(self) -> _TokenEmbeddings:
        """The constant the prompts' embeddings are written into (made on first use: a
        prefill whose prompts run in a longer one's plan needs none)."""
        return _TokenEmbeddings(self.model, self.batch, self.seq)

    def _ids(self, tokens: Any) -> np.ndarray:
        """``tokens`` as checked int64 ids of this shape."""
        ids = self.model._tokens(tokens)
        if ids.shape != (self.batch, self.seq):
            raise ShapeError(f"this {self._what} takes prompts of shape ({self.batch}, "
                             f"{self.seq}); got {ids.shape}")
        return ids

    def _embed(self, tokens: Any) -> np.ndarray:
        """Check ``tokens`` against the shape and write their embeddings in place."""
        ids = self._ids(tokens)
        self.embeddings.write(ids, self.model.embedding_table)
        return ids


class Prefill(_PromptOfShape):
    """The logits of prompts of one shape, (batch, seq) token ids, each a run of ONE query
    planned once: :meth:`Llama.logits` spelt over a constant for the prompt's embeddings
    (written in place for each prompt: the table's rows gathered, or under a
    ``memory_limit`` a one-hot matrix joined with the stored table) -- the rotary tables and
    the causal mask depend on the shape only. The plan is made again when the stored tensors
    or the session's options change.

    A prompt of a new length reuses the plan of the model's last prefill planned from its
    expression (its *template*: the logical plan after the rewrite rules, the same for every
    length but for the sequence's extent): re-bound to the new length, with this prefill's
    embeddings, rotary tables and mask (:meth:`CompiledGroup.with_extent`) and built into a
    physical plan -- no expression graph, no lowering and no rewrite rules; :attr:`rebound`
    says whether that happened. Where it cannot be done unambiguously (the length equals
    another size of the model, or cannot be cut into the template's blocks) the prefill is
    planned from its expression as before.

    With ``pad`` (the default), a prompt shorter than a planned prefill of the same batch
    runs in that prefill's plan instead, padded at its end with token 0, where running the
    extra positions costs less than planning: their share of that prefill's last run time
    against the model's last re-bind (a server's prompts of nearby lengths then plan
    nothing). The causal mask keeps every position from seeing the ones after it, so the
    padding changes none of the prompt's logits; :attr:`padded_to` gives the length the
    last prompt ran at. Its own plan is made when none serves.

    >>> import tensorql as tq
    >>> shape = LlamaShape(vocab=11, d_model=8, d_ff=12, layers=1, heads=2, kv_heads=1,
    ...                    head_dim=4)
    >>> model = Llama.random(tq.connect(), shape, seed=0)
    >>> prompts = model.prefill(batch=1, seq=3)
    >>> all(torch.allclose(prompts.logits(ids), model.logits(ids).torch(), atol=1e-6)
    ...     for ids in ([[1, 2, 3]], [[4, 5, 6]]))
    True
    >>> longer = model.prefill(batch=1, seq=5)
    >>> ids = [[1, 2, 3, 4, 5]]
    >>> bool(torch.allclose(longer.logits(ids), model.logits(ids).torch(), atol=1e-6))
    True
    >>> prompts.rebound, longer.rebound
    (False, True)
    >>> shorter = model.prefill(batch=1, seq=4)  # length 5's plan, padded, if it costs less
    >>> ids = [[1, 2, 3, 4]]
    >>> bool(torch.allclose(shorter.logits(ids), model.logits(ids).torch(), atol=1e-6))
    True
    """

    def __init__(self, model: Llama, batch: int, seq: int, pad: bool = True) -> None:
        super().__init__(model, batch, seq, "prefill")
        self.pad = pad
        self._output: Tensor | None = None
        self._kept: tuple[tuple, Any] | None = None  # (stamp, CompiledGroup)
        self._lock = threading.Lock()  # one prompt at a time through the embeddings
        self.rebound = False  # whether the plan is another length's, re-bound (see above)
        self.padded_to: int | None = None  # the length the last prompt ran at, if padded
        self.run_seconds: float | None = None  # the last run of this prefill's own plan

    @property
    def output(self) -> Tensor:
        """The logits (B, S, V) as a lazy expression over this prefill's embeddings (built
        on first use: a re-bound plan needs none)."""
        if self._output is None:
            model = self.model
            x = self.embeddings.tensor
            for layer in range(model.shape.layers):
                x = model.block(x, layer, self.positions)
            self._output = model.head(x)
        return self._output

    def query(self) -> Any:
        """The planned query (a :class:`~tensorql.pipeline.CompiledGroup` of one output):
        made on first use and again when the stored tensors, the session's options or the
        path cache change; re-bound from the model's template where it can be."""
        from tensorql.pipeline import CompiledGroup

        stamp = self._stamp()
        if self._kept is not None and self._kept[0] == stamp:
            return self._kept[1]
        model = self.model
        template = model._prefill_template
        start = time.perf_counter()
        group = None if template is None else template.rebind(self, stamp)
        self.rebound = group is not None
        if group is None:
            group = CompiledGroup.compile([self.output.node], model.db)
            model._prefill_template = _PrefillTemplate.of(self, group, stamp)
        else:
            model._replan_seconds = time.perf_counter() - start
        self._kept = (stamp, group)
        self.run_seconds = None
        model._planned_prefills[(self.batch, self.seq)] = self
        return group

    def _stamp(self) -> tuple:
        """What a plan is made under: the store's generation, the options, the path cache."""
        from tensorql.logical.path import PATH_CACHE

        db = self.model.db
        return (db.generation, db.options, PATH_CACHE.epoch)

    def constants(self) -> dict[str, torch.Tensor]:
        """What this prefill's plan reads that depends on its length, by role: the
        embeddings (or one-hot tokens) written for each prompt, the rotary tables of the
        keys and of the queries, and the causal mask (absent for one position)."""
        tables, query_tables, mask = self.model._prompt_tables(self.positions)
        out = {"embeddings": self.embeddings.constant.node.value,
               "cos": torch.from_numpy(tables[0]), "sin": torch.from_numpy(tables[1]),
               "query_cos": torch.from_numpy(query_tables[0]),
               "query_sin": torch.from_numpy(query_tables[1])}
        if mask is not None:
            out["mask"] = torch.from_numpy(mask)
        return out

    def logits(self, tokens: Any) -> torch.Tensor:
        """The logits (B, S, V) of token ids ``tokens`` of this prefill's shape (run as a
        query's: every allocation from the heap, so a prompt's chunks reuse the last one's
        pages -- :func:`~tensorql.exec.host_malloc.heap_only`), or those of a longer planned
        prefill run on them padded (see above)."""
        from tensorql.exec.host_malloc import heap_only

        stamp = self._stamp()
        planned = self._kept is not None and self._kept[0] == stamp
        host = None if planned or not self.pad else self.model._padding_host(self, stamp)
        if host is not None:
            ids = self._ids(tokens)
            padded = np.zeros((self.batch, host.seq), dtype=np.int64)
            padded[:, :self.seq] = ids
            self.padded_to = host.seq
            return host.logits(padded)[:, :self.seq]
        with self._lock:
            query = self.query()
            self._embed(tokens)
            self.padded_to = None
            start = time.perf_counter()
            with heap_only():
                out = query.run()[0]
            self.run_seconds = time.perf_counter() - start
            return out


@dataclass(frozen=True)
class _PrefillTemplate:
    """A prefill's plan kept for prompts of other lengths (:class:`Prefill`): its batch and
    length, what it was planned under, and the role of each constant its logical plan scans
    that depends on the length (by the id of the constant's tensor)."""

    batch: int
    seq: int
    stamp: tuple
    group: Any  # CompiledGroup
    roles: tuple[tuple[int, str], ...]
    prefill: Prefill  # the prefill planned (kept: shorter prompts may run in it, padded)

    @classmethod
    def of(cls, prefill: Prefill, group: Any, stamp: tuple) -> _PrefillTemplate | None:
        """The template of ``prefill``, planned as ``group``; None when the group keeps no
        logical plan to re-bind (several devices, a backend of its own)."""
        if group.rewritten is None:
            return None
        from tensorql.logical.plan import Scan, walk

        def at(t: torch.Tensor) -> tuple:
            return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)

        where = {at(value): role for role, value in prefill.constants().items()}
        roles = {}
        for node in walk(*group.rewritten.roots):
            if isinstance(node, Scan) and node.constant is not None:
                role = where.get(at(node.constant))
                if role is not None:
                    roles[id(node.constant)] = role
        return cls(prefill.batch, prefill.seq, stamp, group, tuple(roles.items()), prefill)

    def rebind(self, prefill: Prefill, stamp: tuple) -> Any:
        """The template's plan re-bound to ``prefill``'s length, or None where it cannot be
        (another batch, options or stored tensors; a length of this one's, or the batch's)."""
        if (stamp != self.stamp or prefill.batch != self.batch or prefill.seq == self.seq
                or prefill.batch == self.seq):
            return None
        values = prefill.constants()
        if {role for _, role in self.roles} != set(values):
            return None  # a mask on one side only (a prompt of one position)
        return self.group.with_extent(self.seq, prefill.seq,
                                      {key: values[role] for key, role in self.roles})


class PromptQuery(_PromptOfShape):
    """A prompt of shape (batch, seq) run as ONE query planned once, with what decoding after
    it needs: the last position's logits (B, V) and every layer's rotated keys and values,
    as a :class:`KVCache` -- :meth:`Llama.step` of a prompt with no cache, whose queries
    (two a layer and the head) are planned again for every prompt. The token embeddings
    are written in place for each prompt, as :class:`Prefill`'s; :meth:`Llama.generate`
    keeps one for the next request.

    >>> import tensorql as tq
    >>> shape = LlamaShape(vocab=11, d_model=8, d_ff=12, layers=2, heads=2, kv_heads=1,
    ...                    head_dim=4)
    >>> model = Llama.random(tq.connect(), shape, seed=0)
    >>> query = PromptQuery(model, batch=1, seq=3)
    >>> logits, cache = query.run([[1, 2, 3]])
    >>> want, want_cache = model.step([[1, 2, 3]], KVCache(()))
    >>> bool(torch.allclose(logits, want, atol=1e-5)), cache.length, all(
    ...     torch.allclose(a, b, atol=1e-5) for a, b in zip(cache.layers, want_cache.layers))
    (True, 3, True)
    """

    def __init__(self, model: Llama, batch: int, seq: int) -> None:
        from tensorql.pipeline import CompiledGroup

        super().__init__(model, batch, seq, "prompt query")
        self._lock = threading.Lock()
        x = self.embeddings.tensor
        outputs = []
        for layer in range(model.shape.layers):
            x, keys, values = model._prompt_block(x, layer, self.positions)
            outputs += [keys, values]
        logits = model.head(x[:, self.seq - 1:, :])
        self.query = CompiledGroup.compile([t.node for t in (logits, *outputs)], model.db)

    def run(self, tokens: Any) -> tuple[torch.Tensor, KVCache]:
        """The last position's logits (B, V) of prompt ``tokens`` (B, S) and its KVCache."""
        with self._lock:  # one prompt at a time through the embeddings
            self._embed(tokens)
            logits, *outputs = self.query.run()
        layers = tuple(torch.stack([keys, values]) for keys, values
                       in zip(outputs[0::2], outputs[1::2]))
        return logits[:, 0, :], KVCache(layers)


def _contracted_dims(weight: str) -> int:
    """How many trailing dims of weight ``weight`` (a key of ``Llama.weights``) a token's
    product with it contracts: the output projection all three of (kv_head, group, head_dim),
    every other matrix its last (d_model, or d_ff for the down projection)."""
    return 3 if weight.endswith("_wo") else 1


def _matvec_layout(value: torch.Tensor, contracted: int) -> torch.Tensor:
    """``value`` (same shape and entries) laid out in memory for products with one token:
    with its last ``contracted`` dims outermost when the other dims (the product's output)
    are longer than they are. A one-token product is a matrix-vector product bound by memory
    bandwidth, and its kernels stream a weight fastest along long rows: here a 32000 x 768
    LM head read as ``x @ W`` over rows of 32000 runs at 26 GB/s against 13.5 GB/s as
    ``x @ W.T`` over rows of 768 (one or two threads); the down projection (768 x 2048,
    contracting 2048) is read fastest as it is stored.

    >>> w = torch.arange(6.0).reshape(3, 2)  # output 3 > contracted 2: contracted outermost
    >>> t = _matvec_layout(w, 1)
    >>> torch.equal(t, w), t.stride(), _matvec_layout(w.T.contiguous(), 1).stride()
    (True, (1, 3), (3, 1))
    """
    if value.dim() < 2 or contracted >= value.dim():
        return value
    kept = value.dim() - contracted
    if math.prod(value.shape[:kept]) <= math.prod(value.shape[kept:]):
        return value
    order = (*range(kept, value.dim()), *range(kept))
    inverse = [order.index(d) for d in range(value.dim())]
    return value.permute(order).contiguous().permute(inverse)


class Decoder:
    """Decoding one token per call with ONE query planned once: a static KV cache of
    ``max_length`` positions per layer (in memory, written in place after each token), and the
    token's embedding row (looked up in the table), its rotary matrices, the causal mask and the
    one-hot of its position as constants updated in place -- so every token runs the same plan
    (every layer and the LM head, each layer's new keys/values as further outputs of the same
    multi-output query). The weights are held in memory for the decoder's life unless the
    session has a ``memory_limit`` (then they stream from the store every token).

    The new token attends to the cache (zeros at its position and beyond, masked beyond it),
    its own score added at its position and its own value weighted by the probability there
    (:meth:`Llama._decode_block`), so attention spans ``max_length`` positions. The weights
    are laid out for one-token products (see :func:`_matvec_layout`).

    >>> import tensorql as tq
    >>> shape = LlamaShape(vocab=11, d_model=8, d_ff=12, layers=1, heads=2, kv_heads=1,
    ...                    head_dim=4)
    >>> model = Llama.random(tq.connect(), shape, seed=0)
    >>> logits, cache = model.step([[1, 2, 3]], KVCache(()))
    >>> decoder = model.decoder(cache, max_length=6)
    >>> expected, _ = model.step([[4]], cache)
    >>> bool(torch.allclose(decoder.step([[4]]), expected, atol=1e-5)), decoder.position
    (True, 4)
    """

    def __init__(self, model: Llama, cache: KVCache, max_length: int) -> None:
        from tensorql.pipeline import CompiledGroup

        s = model.shape
        if not cache.layers:
            raise ShapeError("a decoder continues a prefill: give the KVCache of a step()")
        model._check_cache(cache)
        batch = int(cache.layers[0].shape[1])
        self.model, self.position, self.max_length = model, cache.length, int(max_length)
        if self.position >= self.max_length:
            raise ShapeError(f"the cache already holds {self.position} positions of "
                             f"max_length {self.max_length}")
        db = model.db
        self.caches = []
        for past in cache.layers:
            buffer = torch.zeros((2, batch, self.max_length, s.kv_heads, s.head_dim),
                                 dtype=past.dtype)
            buffer[:, :, :self.position] = past
            self.caches.append(buffer)
        self.batch = batch
        # the token's rotary embedding as matrices (rotation_matrix): the queries' (scaled
        # by 1/sqrt(head_dim)); the keys' (p = 0) beside the identity for the values (p = 1)
        self.rotation_q = torch.zeros((s.head_dim, s.head_dim))
        self.rotation_kv = torch.zeros((2, s.head_dim, s.head_dim))
        self.rotation_kv[1] = torch.eye(s.head_dim)
        self.mask = torch.zeros((1, self.max_length))
        self.place = torch.zeros((1, self.max_length))
        # the token's embedding row, gathered from the table as it is now (the decoder
        # holds the weights of its creation, so the table too)
        self.embeddings = _TokenEmbeddings(model, batch, 1)
        self.table = None if self.embeddings.hidden is None else model.embedding_table()
        x = self.embeddings.tensor
        news = []
        for layer, buffer in enumerate(self.caches):
            xn = model._rmsnorm(x, f"l{layer}_attn_norm")  # once, for q and k, v
            # (B, 1, 2, KV, E): the token's row times the weight, straight (keys and values
            # after the positions: a one-row matrix product, with no permuted copy)
            new = einsum("bspke,pef->bspkf",
                         einsum("bsd,pked->bspke", xn, model._w(f"l{layer}_wkv")),
                         db.constant(self.rotation_kv))
            x = model._decode_block(x, xn, layer, db.constant(self.rotation_q),
                                    db.constant(self.mask),
                                    (db.constant(buffer[0]), db.constant(buffer[1])), new,
                                    db.constant(self.place))
            news.append(new)
        logits = model.head(x)
        # the weights in memory for the decoder's life, so a token reads no store chunk --
        # unless a memory_limit is set: then they stream from rest under it every token
        # -- each one chunk (a token's product with a weight is one task, one pass over it)
        # laid out for a matrix-vector product (see _matvec_layout)
        # (read as one region of the store: the chunk cache's own tensor, no query and no
        # copy, unless the layout needs one -- they are never written)
        self.weights = {} if db.options.memory_limit is not None else {
            w.node.name: Constant(shape=w.shape, dtype=w.dtype,
                                  value=_matvec_layout(model._stored(key),
                                                       _contracted_dims(key)),
                                  grid=ChunkGrid(w.shape, w.shape))
            for key, w in model.weights.items()}
        roots = substitute_many([n.node for n in (logits, *news)], self.weights)
        self.query = CompiledGroup.compile(roots, db)
        # the plan lowered to its tape now, as part of building the decoder (one run on the
        # inputs as they are; its values are not used): every token then replays it (under
        # a memory_limit, on several devices or ranks, the engine runs its own strategy:
        # nothing to lower)
        options = db.options
        if options.memory_limit is None and not options.distributed \
                and options.device_set.count == 1 and options.device_set.all_cpu:
            self.query.run(strategy="tape")

    def restart(self, cache: KVCache) -> None:
        """Continue after ``cache`` (another prompt's, of this decoder's batch) instead: the
        same plan and weights, the cache buffers rewritten (zero beyond the prompt).

        >>> import tensorql as tq
        >>> shape = LlamaShape(vocab=11, d_model=8, d_ff=12, layers=1, heads=2, kv_heads=1,
        ...                    head_dim=4)
        >>> model = Llama.random(tq.connect(), shape, seed=0)
        >>> decoder = model.decoder(model.step([[1, 2, 3]], KVCache(()))[1], max_length=6)
        >>> _ = decoder.step([[4]])
        >>> _, other = model.step([[5, 6]], KVCache(()))
        >>> decoder.restart(other)
        >>> expected, _ = model.step([[7]], other)
        >>> bool(torch.allclose(decoder.step([[7]]), expected, atol=1e-5)), decoder.position
        (True, 3)
        """
        if len(cache.layers) != len(self.caches) or int(cache.layers[0].shape[1]) != self.batch:
            raise ShapeError(f"a decoder of batch {self.batch} and {len(self.caches)} layers "
                             f"cannot restart on a KVCache of {len(cache.layers)} layers"
                             + (f" and batch {int(cache.layers[0].shape[1])}"
                                if cache.layers else ""))
        position = cache.length
        if position >= self.max_length:
            raise ShapeError(f"the cache already holds {position} positions of "
                             f"max_length {self.max_length}")
        for buffer, past in zip(self.caches, cache.layers):
            buffer[:, :, :position] = past
            buffer[:, :, position:] = 0.0
        self.position = position

    def step(self, tokens: Any) -> torch.Tensor:
        """Run one token per batch row ((B, 1) ids) at the next position; its logits (B, V).
        The plan runs as a tape (:mod:`tensorql.exec.tape`): lowered on the first token
        into bound kernel calls over buffers, replayed for every later one."""
        t = self._set_token(tokens)
        logits, *news = self.query.run(strategy="tape")
        self._append(t, news)
        return logits[:, 0, :]

    def _set_token(self, tokens: Any) -> int:
        """Write the token's inputs of the plan in place (its embedding row, rotations, mask,
        one-hot of its position); its position."""
        ids = self.model._tokens(tokens)
        if ids.shape != (self.batch, 1):
            raise ShapeError(f"a decoder step takes one token per batch row, shape "
                             f"({self.batch}, 1); got {ids.shape}")
        t = self.position
        if t >= self.max_length:
            raise ShapeError(f"the decoder is full: max_length {self.max_length} positions")
        self.embeddings.write(ids, lambda: self.table)
        cos, sin = rope_tables(self.model.shape, [t])
        rotation = torch.from_numpy(rotation_matrix(cos[0], sin[0]))
        self.rotation_kv[0].copy_(rotation)
        self.rotation_q.copy_(rotation).mul_(1.0 / math.sqrt(self.model.shape.head_dim))
        self.mask.fill_(MASK_VALUE)
        self.mask[0, :t + 1] = 0.0
        self.place.zero_()
        self.place[0, t] = 1.0
        return t

    def _append(self, t: int, news: Sequence[torch.Tensor]) -> None:
        """The token's keys and values (the plan's further outputs) into the cache at ``t``."""
        for buffer, new in zip(self.caches, news):
            buffer[:, :, t] = new[:, 0].transpose(0, 1)
        self.position = t + 1
