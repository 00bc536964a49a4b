"""Attention as one step: ``softmax(q . k [+ mask]) . v`` found in a logical plan and run by
one fused chunk kernel per output chunk.

The logical plan spells attention as four relational steps -- the scores (an aggregate of
q joined with k), an optional additive mask (a join), a softmax over the key label, and the
weighted values (an aggregate of the probabilities joined with v) -- each materialising a
(queries x keys) relation per head. Where that chain stands alone (every intermediate read
only by the next step, all in one chunk along the key and head-dim labels), the physical
planner runs it as one :class:`AttentionChunk` task per output chunk, which calls torch's
``scaled_dot_product_attention``: no scores relation in memory, one pass instead of four.
A 512-token LLaMA layer's attention (12 heads, GQA 12/4): 16 ms as four steps, ~6 ms fused
(2 threads, this repository's AMD host).

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
from tensorql.logical.plan import Aggregate, Join, LogicalNode, Map, Softmax

Labels = tuple[str, ...]
_FLOATS = ("float32", "float64")


@dataclass(frozen=True, eq=False)
class AttentionChunk:
    """``softmax(q . k + mask) . v`` for one output chunk (labels as in the module doc);
    inputs ``[q, k, v]`` or ``[q, k, v, mask]``."""

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

    @property
    def input_labels(self) -> tuple[Labels, ...]:
        """The labels of each input, in the order ``run`` takes them."""
        return (self.q, self.k, self.v) + ((self.mask,) if self.mask is not None else ())

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
    if not (isinstance(node, Aggregate) and node.agg == "sum" and isinstance(node.input, Join)):
        return None
    join = node.input
    if join.join != "mul" or len(join.sources) != 2 or any(
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
    # scores (perhaps scaled), with the mask added where there is one
    scores, add, mask, mask_labels = soft.input, None, None, None
    if isinstance(scores, Join) and scores.join == "add" and len(scores.sources) == 2:
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
             + ([add] if add is not None else []) + [soft, pv_join])
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
    if not _one_chunk_along(q, q_labels, e) or not _one_chunk_along(k, k_labels, (*e, *t)) \
            or not _one_chunk_along(v, v_labels, t) \
            or (mask is not None and not _one_chunk_along(mask, mask_labels, t)):
        return None
    kernel = AttentionChunk(q=q_labels, k=k_labels, v=v_labels, mask=mask_labels,
                            out=out.relation.labels, n=n, s=s, e=e, t=t, v_only=v_only,
                            dtype=out.relation.dtype,
                            scale=scale_map.scalar if scale_map is not None else 1.0)
    if not _tiles_agree(out, kernel, sources):
        return None
    return AttentionGroup(tuple(chain + [out]), q, k, v, mask, kernel)


def _one_chunk_along(node: LogicalNode, labels: Sequence[str], whole: Labels) -> bool:
    grid = node.relation.grid
    return all(grid.blocks[list(labels).index(label)] == 1 for label in whole)


def _tiles_agree(out: LogicalNode, kernel: AttentionChunk,
                 sources: Sequence[LogicalNode]) -> bool:
    """Whether each source's tiles along the output's labels are the output's (so one
    chunk of each source feeds one output chunk); the softmax label is whole everywhere."""
    tile = dict(zip(out.relation.labels, out.relation.grid.tile))
    for src, labels in zip(sources, kernel.input_labels):
        for label, size in zip(labels, src.relation.grid.tile):
            if label in tile and tile[label] != size:
                return False
    return True


__all__ = ["AttentionChunk", "AttentionGroup", "attention_groups"]
