"""Attention as one step: ``softmax(q . k [+ mask]) . v`` found in a logical plan and run by
one fused chunk kernel per output chunk.

The logical plan spells attention as four relational steps -- the scores (an aggregate of
q joined with k), an optional additive mask (a join), a softmax over the key label (its
input retiled to whole rows of keys), and the weighted values (an aggregate of the
probabilities joined with v) -- each materialising a (queries x keys) relation per head.
Where that chain stands alone (every intermediate read only by the next step), the physical
planner runs it as one :class:`AttentionChunk` task per output chunk, which calls torch's
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

from tensorql.algebra import AggName, JoinName
from tensorql.dtypes import torch_dtype
from tensorql.logical.lower import retile
from tensorql.logical.plan import Aggregate, Join, LogicalNode, Map, Rekey, Softmax

Labels = tuple[str, ...]
_FLOATS = ("float32", "float64")
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


@dataclass(frozen=True)
class AttentionGroup:
    """An attention chain of a logical plan: its nodes, last (the weighted values) last, and
    the kernel computing it."""

    members: tuple[LogicalNode, ...]
    q: LogicalNode
    k: LogicalNode
    v: LogicalNode
    mask: LogicalNode | None
    kernel: AttentionChunk

    @property
    def sources(self) -> tuple[LogicalNode, ...]:
        return (self.q, self.k, self.v) + ((self.mask,) if self.mask is not None else ())


def attention_groups(nodes: list[LogicalNode],
                     roots: tuple[LogicalNode, ...]) -> dict[int, AttentionGroup]:
    """The attention chains among ``nodes`` that run as one step, by the id of each chain's
    last node (see the module doc for what qualifies)."""
    readers: dict[int, int] = {}
    for node in nodes:
        for child in node.inputs:
            readers[id(child)] = readers.get(id(child), 0) + 1
    for root in roots:  # a result is read by the caller
        readers[id(root)] = readers.get(id(root), 0) + 1
    groups = {}
    for node in nodes:
        group = _match(node, readers)
        if group is not None:
            groups[id(node)] = group
    return groups


def _product(node: LogicalNode) -> tuple[Aggregate, Join] | None:
    """``node`` as a sum over a two-input product with no repeated label, else None."""
    if not (isinstance(node, Aggregate) and node.agg == AggName.SUM
            and isinstance(node.input, Join)):
        return None
    join = node.input
    if join.join != JoinName.MUL or len(join.sources) != 2 or any(
            len(set(labels)) != len(labels) for labels in join.input_labels):
        return None
    return node, join


def _scaled_product(node: LogicalNode) -> tuple[tuple[Aggregate, Join], Map | None] | None:
    """``node`` as a product (see :func:`_product`), or a product times a constant (a Map
    ``scale``, as 1/sqrt(head_dim) often is); with that Map, else None in its place."""
    if isinstance(node, Map) and node.fn == "scale" and node.scalar is not None:
        product = _product(node.input)
        return (product, node) if product is not None else None
    product = _product(node)
    return (product, None) if product is not None else None


def _match(out: LogicalNode, readers: dict[int, int]) -> AttentionGroup | None:
    """The attention chain ending at ``out``, or None. Each node names its labels afresh
    (a consumer's input labels rename its producer's dims by position), so the chain's
    labels are translated to those of the last product (q's and k's contracted labels get
    names of their own)."""
    pv = _product(out)
    if pv is None:
        return None
    _, pv_join = pv
    sides = [k for k, src in enumerate(pv_join.sources) if isinstance(src, Softmax)]
    if len(sides) != 1:
        return None
    soft = pv_join.sources[sides[0]]
    v, v_labels = pv_join.sources[1 - sides[0]], tuple(pv_join.input_labels[1 - sides[0]])
    p_labels = tuple(pv_join.input_labels[sides[0]])
    if soft.log or soft.relation.labels != soft.input.relation.labels:
        return None
    t = (p_labels[soft.relation.labels.index(soft.label)],)
    if tuple(out.over) != t:
        return None
    # scores (perhaps scaled), with the mask added where there is one; a retiling of them
    # for the softmax (whole rows of keys) is never made: the fused step has no scores
    scores, rekey = soft.input, None
    if isinstance(scores, Rekey):
        rekey, scores = scores, scores.input
    add, mask, mask_labels = None, None, None
    if isinstance(scores, Join) and scores.join == JoinName.ADD and len(scores.sources) == 2:
        add = scores
        firsts = [k for k, src in enumerate(add.sources) if _scaled_product(src) is not None
                  and tuple(add.input_labels[k]) == add.relation.labels]
        if not firsts:
            return None
        scores = add.sources[firsts[0]]
        mask, mask_labels = add.sources[1 - firsts[0]], add.input_labels[1 - firsts[0]]
        if len(set(mask_labels)) != len(mask_labels):
            return None
        mask_labels = tuple(p_labels[add.relation.labels.index(lab)] for lab in mask_labels)
    scaled = _scaled_product(scores)
    if scaled is None:
        return None
    (qk_agg, qk_join), scale_map = scaled
    chain = ([qk_join, qk_agg] + ([scale_map] if scale_map is not None else [])
             + ([add] if add is not None else []) + ([rekey] if rekey is not None else [])
             + [soft, pv_join])
    if any(readers.get(id(node), 0) != 1 for node in chain):
        return None  # an intermediate read elsewhere (e.g. kept for a gradient) stays
    rename = dict(zip(qk_agg.relation.labels, p_labels))
    rename |= {lab: f"{lab}'qk" for lab in qk_agg.over}
    (q, k) = qk_join.sources
    q_labels, k_labels = (tuple(rename[lab] for lab in labels)
                          for labels in qk_join.input_labels)
    e = tuple(rename[lab] for lab in qk_agg.over)
    n = tuple(lab for lab in q_labels if lab in k_labels and lab not in e)
    s = tuple(lab for lab in q_labels if lab not in k_labels)
    v_only = tuple(lab for lab in v_labels if lab not in n and lab not in t)
    if (set(k_labels) != set(n) | set(e) | set(t) or set(p_labels) != set(n) | set(s) | set(t)
            or not set(n) | set(t) <= set(v_labels) or set(v_only) & set(s)
            or set(out.relation.labels) != set(n) | set(s) | set(v_only)):
        return None
    sources = [q, k, v] + ([mask] if mask is not None else [])
    if any(src.relation.dtype not in _FLOATS for src in sources) or \
            out.relation.dtype not in _FLOATS:
        return None
    # a source the lowering retiled for this chain alone is read from before that copy
    copies = [src for src in sources if isinstance(src, Rekey) and readers.get(id(src)) == 1]
    sources = [src.input if src in copies else src for src in sources]
    k = sources[1]
    labels = (q_labels, k_labels, v_labels) + ((mask_labels,) if mask is not None else ())
    sources = [_fed(src, lab, out, e, t[0], k, k_labels) for src, lab in zip(sources, labels)]
    kernel = AttentionChunk(q=q_labels, k=k_labels, v=v_labels, mask=mask_labels,
                            out=out.relation.labels, n=n, s=s, e=e, t=t, v_only=v_only,
                            dtype=out.relation.dtype,
                            scale=scale_map.scalar if scale_map is not None else 1.0,
                            key_blocks=sources[1].relation.grid.blocks[k_labels.index(t[0])])
    q, k, v = sources[:3]
    mask = sources[3] if mask is not None else None
    return AttentionGroup(tuple(copies + chain + [out]), q, k, v, mask, kernel)


def _fed(source: LogicalNode, labels: Labels, out: LogicalNode, e: Labels, key: str,
         k: LogicalNode, k_labels: Labels) -> LogicalNode:
    """``source`` (its dims named ``labels``) on the tiles the fused step reads it in: the
    output's tiles along the output's labels (one chunk of it feeds one output chunk), the
    head dim ``e`` whole, and along the keys ``key`` the tiles of k (a task takes every
    chunk along the keys of k, v and the mask, in the same blocks). Already so, it is
    itself; else a ``Rekey`` (or a constant's scan on those tiles) that the planner adds."""
    tiles = dict(zip(labels, source.relation.grid.tile))
    tiles |= {label: size for label, size in zip(labels, source.relation.shape) if label in e}
    tiles |= {label: tile for label, tile in zip(out.relation.labels, out.relation.grid.tile)
              if label in tiles}
    if key in tiles:
        tiles[key] = k.relation.grid.tile[k_labels.index(key)]
    return retile(source, labels, tiles)


__all__ = ["AttentionChunk", "AttentionGroup", "attention_groups"]
