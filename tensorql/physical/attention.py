"""Attention as one step: the kernel of an ``Attention`` node (``softmax(q . k [+ mask]) . v``,
matched in the logical plan by the rule :mod:`tensorql.logical.rules.attention`), one fused
chunk kernel per output chunk.

The logical plan spells attention as four relational steps -- the scores (an aggregate of
q joined with k), an optional additive mask (a join), a softmax over the key label (its
input retiled to whole rows of keys), and the weighted values (an aggregate of the
probabilities joined with v) -- each materialising a (queries x keys) relation per head.
Where that chain stands alone (every intermediate read only by the next step), the rule
makes it one node and the planner runs it as one :class:`AttentionChunk` task per output
chunk, which calls torch's
``scaled_dot_product_attention``: no scores relation in memory, one pass instead of four.
A task reads its block of queries (q retiled to the output's blocks when they differ) and
every block of keys, values and mask along the keys, joined in the kernel -- except the
key blocks its mask hides from all its queries (a causal mask's keys after the block's
last query), which it leaves out. A 512-token LLaMA layer's attention (12 heads, GQA 12/4):
16 ms as four steps, ~6 ms fused (2 threads, this repository's AMD host), and ~3/4 of that
with the prompt in two blocks of queries, the first skipping the later keys.

The chain is recognised by labels alone (no model knowledge): ``N`` labels in q, k and v
(batch, key/value head), ``S`` labels only in q (query positions, query groups), ``E`` the
contracted head dim of q and k, ``T`` the softmax label (key positions, in k and v), ``V``
labels only in v (its head dim).

>>> import torch
>>> k = AttentionChunk(q=("b", "s", "e"), k=("b", "t", "e"), v=("b", "t", "f"), mask=None,
...                    out=("b", "s", "f"), n=("b",), s=("s",), e=("e",), t=("t",),
...                    v_only=("f",), dtype="float32")
>>> q, kk, v = torch.randn(2, 3, 4), torch.randn(2, 5, 4), torch.randn(2, 5, 6)
>>> want = torch.softmax(torch.einsum("bse,bte->bst", q, kk), -1) @ v
>>> torch.allclose(k.run([q, kk, v], None), want, atol=1e-6)
True
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tensorql.dtypes import torch_dtype
from tensorql.logical.plan import Attention

Labels = tuple[str, ...]
MASKED_OUT = -1e9  # a mask entry at or below this hides its key (see AttentionChunk._seen)


@dataclass(frozen=True, eq=False)
class AttentionChunk:
    """``softmax(q . k + mask) . v`` for one output chunk (labels as in the module doc);
    inputs: q's chunk, then ``key_blocks`` chunks each of k, v and (if any) the mask, in key
    order."""

    q: Labels
    k: Labels
    v: Labels
    mask: Labels | None
    out: Labels
    n: Labels
    s: Labels
    e: Labels
    t: Labels
    v_only: Labels
    dtype: str
    scale: float = 1.0  # the scores' factor (a Map scale on the product)
    key_blocks: int = 1  # chunks of k, v (and the mask) along the softmax label, per task

    @property
    def input_labels(self) -> tuple[Labels, ...]:
        """The labels of each source (q, k, v, then the mask if any); ``run`` takes q, then
        ``key_blocks`` chunks of each other source in key order."""
        return (self.q, self.k, self.v) + ((self.mask,) if self.mask is not None else ())

    def _keys_whole(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``inputs`` as one tensor per source: each source's key chunks joined along the
        softmax label (a copy of k and v, small next to the scores it saves), leaving out
        the key blocks the mask hides from every query of this chunk (:meth:`_seen`)."""
        m = self.key_blocks
        if m == 1:
            return list(inputs)
        sources = [inputs[1 + n * m:1 + (n + 1) * m] for n in range(len(self.input_labels) - 1)]
        seen = self._seen(sources[2]) if self.mask is not None else range(m)
        whole = [inputs[0]]
        for blocks, labels in zip(sources, self.input_labels[1:]):
            kept = [blocks[b] for b in seen]
            whole.append(kept[0] if len(kept) == 1 else
                         torch.cat(kept, dim=labels.index(self.t[0])))
        return whole

    def _seen(self, masks: Sequence[torch.Tensor]) -> list[int]:
        """The key blocks to attend to: all but those whose mask is at most ``MASKED_OUT``
        everywhere (under a causal mask, the keys after the chunk's last query), provided
        every query still sees some key in the rest -- their scores then weigh exactly 0
        (exp of a score that far below the row's maximum underflows in float32 and float64
        for any score under 1e8 in size), so leaving them out changes no result. Decided at
        run time: a constant mask may be rewritten between runs (a decoder's is)."""
        hidden = [bool((mask <= MASKED_OUT).all()) for mask in masks]
        seen = [b for b, h in enumerate(hidden) if not h]
        if not seen or len(seen) == len(masks):
            return list(range(len(masks)))
        key_dim = self.mask.index(self.t[0])
        visible = torch.stack([masks[b].amax(dim=key_dim) for b in seen]).amax(dim=0)
        return seen if bool((visible > MASKED_OUT).all()) else list(range(len(masks)))

    @property
    def groups(self) -> Labels:
        """Query-only labels the mask does not have (a GQA head's query group): with the
        N labels they make the query heads, each reading the keys/values of its N index
        (``enable_gqa``), while the mask broadcasts over them."""
        return tuple(lab for lab in self.s if self.mask is None or lab not in self.mask)

    @property
    def positions(self) -> Labels:
        """Query-only labels the mask has (the query positions)."""
        return tuple(lab for lab in self.s if lab not in self.groups)

    def run(self, inputs: Sequence[torch.Tensor], acc: torch.Tensor | None) -> torch.Tensor:
        dtype = torch_dtype(self.dtype)
        inputs = self._keys_whole(inputs)
        q, k, v = (x if x.dtype == dtype else x.to(dtype) for x in inputs[:3])
        sizes = dict(zip(self.q, q.shape)) | dict(zip(self.k, k.shape)) | dict(zip(self.v,
                                                                                  v.shape))
        heads = (*self.n, *self.groups)
        q4 = _grouped(q, self.q, (heads, self.positions, self.e)).unsqueeze(0)
        k4 = _grouped(k, self.k, (self.n, self.t, self.e)).unsqueeze(0)
        v4 = _grouped(v, self.v, (self.n, self.t, self.v_only)).unsqueeze(0)
        mask = None
        if self.mask is not None:
            mask = _mask(inputs[3].to(dtype), self.mask, self.n, self.groups, self.positions,
                         self.t, sizes)
        out = torch.nn.functional.scaled_dot_product_attention(
            q4, k4, v4, attn_mask=mask, scale=self.scale, enable_gqa=q4.shape[1] != k4.shape[1])
        order = (*heads, *self.positions, *self.v_only)
        out = out.reshape([sizes[label] for label in order])
        return out.permute([order.index(label) for label in self.out]).contiguous()

    def combine(self, acc: torch.Tensor, partial: torch.Tensor) -> torch.Tensor:
        raise AssertionError("an attention chunk is written once")


def _grouped(x: torch.Tensor, labels: Labels, groups: tuple[Labels, ...]) -> torch.Tensor:
    """``x`` permuted to the labels of ``groups`` in order, one dim per group."""
    order = [labels.index(label) for group in groups for label in group]
    x = x.permute(order)
    shape, at = [], 0
    for group in groups:
        shape.append(math.prod(x.shape[at:at + len(group)]))
        at += len(group)
    return x.reshape(shape)


def _mask(mask: torch.Tensor, labels: Labels, n: Labels, groups: Labels, positions: Labels,
          t: Labels, sizes: dict[str, int]) -> torch.Tensor:
    """The additive mask as ``scaled_dot_product_attention`` broadcasts it: (L, T) over
    query positions and keys -- a view, whatever the heads -- or, when it varies with an N
    label (say a batch's padding), (1, heads, L, T) expanded over the query groups."""
    has_n = any(label in labels for label in n)
    order = [*(n if has_n else ()), *(groups if has_n else ()), *positions, *t]
    present = [label for label in order if label in labels]
    view = mask.permute([labels.index(label) for label in present])
    own = dict(zip(present, view.shape))
    view = view.reshape([own.get(label, 1) for label in order])
    view = view.expand([sizes[label] for label in order])
    rows = math.prod(sizes[label] for label in positions)
    keys = math.prod(sizes[label] for label in t)
    if not has_n:
        return view.reshape(rows, keys)
    return view.reshape(1, math.prod(sizes[label] for label in (*n, *groups)), rows, keys)


def attention_kernel(node: Attention, key_blocks: int = 1) -> AttentionChunk:
    """The kernel of an :class:`~tensorql.logical.plan.Attention` node (the rule
    :mod:`tensorql.logical.rules.attention` matched it), taking ``key_blocks`` chunks of
    k, v and the mask along the keys per task."""
    lab = node.labels
    return AttentionChunk(q=lab.q, k=lab.k, v=lab.v, mask=lab.mask, out=lab.out, n=lab.n,
                          s=lab.s, e=lab.e, t=lab.t, v_only=lab.v_only,
                          dtype=node.relation.dtype, scale=node.scale, key_blocks=key_blocks)


__all__ = ["MASKED_OUT", "AttentionChunk", "attention_kernel"]
