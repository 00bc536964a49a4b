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

Within a task, a mask that hides a tail of the keys from a run of queries (a causal mask's
keys after each run's last query) has the task's queries attended in runs of
:data:`SUB_ROWS` positions, each over only the keys some query of the run sees
(:func:`key_ends`): torch's CPU kernel computes every score of its key block and masks it
afterwards, so a 256-query causal block costs as much as an unmasked one (512 keys: 15.4 ms
causal, 14.9 ms unmasked, one thread). A 512-token LLaMA layer's two tasks: 10.8 -> 9.0 ms
(one thread, median of 15). Which key blocks and key runs a mask hides is worked out once
per mask chunk and kept while that tensor lives unwritten (:func:`mask_layout`): the checks
cost ~0.3 ms a block, every run.

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
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tensorql.dtypes import torch_dtype
from tensorql.logical.plan import Attention

Labels = tuple[str, ...]
MASKED_OUT = -1e9  # a mask entry at or below this hides its key (see AttentionChunk._seen)
SUB_ROWS = 64  # query positions a call where the mask hides keys from some (see key_ends)
LAYOUTS_MAX = 1024  # mask layouts kept (see mask_layout)


@dataclass(frozen=True)
class MaskLayout:
    """What a task's mask chunks hide, worked out once per chunk (:func:`mask_layout`):
    ``seen`` the key blocks to attend to (:meth:`AttentionChunk._seen`), ``ends`` per run
    of :data:`SUB_ROWS` query positions the number of leading keys (of the seen blocks,
    joined) to attend to, or None where every run sees every key (one call)."""

    seen: tuple[int, ...]
    ends: tuple[int, ...] | None


# mask_layout's answers: the mask chunks' tensors and regions -> (weak references to the
# tensors, the chunks' versions, the layout)
_LAYOUTS: dict[tuple, tuple[tuple, tuple, MaskLayout]] = {}
_layouts_lock = threading.Lock()


def key_ends(mask: torch.Tensor, rows: int = SUB_ROWS) -> tuple[int, ...] | None:
    """Per run of ``rows`` query positions of ``mask`` (..., positions, keys), the number of
    leading keys its queries see (one past the last key some query of the run does not
    hide), or None where no run can leave keys out. A run in which a query sees no key at
    all keeps every key (its softmax spreads over all of them, hidden or not).

    >>> causal = torch.triu(torch.full((4, 4), -1e9), 1)
    >>> key_ends(causal, rows=2), key_ends(torch.zeros(4, 4), rows=2)
    ((2, 4), None)
    """
    visible = mask > MASKED_OUT
    while visible.dim() > 2:  # a mask varying with the heads: what any head sees
        visible = visible.any(dim=0)
    positions, keys = visible.shape
    if positions <= rows:
        return None
    any_seen = visible.any(dim=1)
    last = keys - 1 - visible.flip(1).to(torch.uint8).argmax(dim=1)  # last key seen a row
    ends = []
    for r0 in range(0, positions, rows):
        seen = bool(any_seen[r0:r0 + rows].all())
        ends.append(int(last[r0:r0 + rows].max()) + 1 if seen else keys)
    return None if all(end == keys for end in ends) else tuple(ends)


def mask_layout(masks: Sequence[torch.Tensor], work: Callable[[], MaskLayout]) -> MaskLayout:
    """``work()``, the :class:`MaskLayout` of the mask chunks ``masks``, kept for the same
    chunks: answered again while each is the same region (address, shape, strides) of the
    same live tensor (a chunk of a constant is a new view of it every run), unwritten since
    (its version) -- a decoder's mask written in place is worked out again, a chunk
    computed afresh is another tensor. An inference tensor (made under
    ``torch.inference_mode``) counts no versions: its layout is worked out every run.

    >>> m = torch.zeros(4, 2)
    >>> calls = []
    >>> def work():
    ...     calls.append(1)
    ...     return MaskLayout((0,), None)
    >>> mask_layout([m[:2]], work) == mask_layout([m[:2]], work), len(calls)
    (True, 1)
    >>> _ = m.fill_(1.0)  # written: worked out again
    >>> _ = mask_layout([m[:2]], work); len(calls)
    2
    """
    if any(m.is_inference() for m in masks):
        return work()  # made under torch.inference_mode: no version counter to trust
    roots = [m if m._base is None else m._base for m in masks]
    key = tuple((id(r), m.data_ptr(), tuple(m.shape), m.stride()) for r, m in zip(roots, masks))
    versions = tuple(m._version for m in masks)
    kept = _LAYOUTS.get(key)
    if kept is not None and kept[1] == versions and all(
            ref() is r for ref, r in zip(kept[0], roots)):
        return kept[2]
    layout = work()
    with _layouts_lock:
        if len(_LAYOUTS) >= LAYOUTS_MAX:
            _LAYOUTS.clear()
        _LAYOUTS[key] = (tuple(weakref.ref(r) for r in roots), versions, layout)
    return layout


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

    def _keys_whole(self, inputs: Sequence[torch.Tensor],
                    seen: Sequence[int]) -> list[torch.Tensor]:
        """``inputs`` as one tensor per source: each source's key chunks joined along the
        softmax label (a copy of k and v, small next to the scores it saves), leaving out
        the key blocks the mask hides from every query of this chunk (``seen`` the others,
        :meth:`_seen`)."""
        m = self.key_blocks
        if m == 1:
            return list(inputs)
        sources = [inputs[1 + n * m:1 + (n + 1) * m] for n in range(len(self.input_labels) - 1)]
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
        m = self.key_blocks
        masks = inputs[1 + 2 * m:1 + 3 * m] if self.mask is not None else None
        # the layout reads the mask on the host: on a GPU that is a sync per task and the
        # runs of SUB_ROWS positions are launches too small for the device -- one call there
        on_host = masks is not None and masks[0].device.type == "cpu"
        layout = mask_layout(masks, lambda: self._layout(inputs)) if on_host else None
        inputs = self._keys_whole(inputs, range(m) if layout is None else layout.seen)
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
        out = self._attend(q4, k4, v4, mask, None if layout is None else layout.ends)
        order = (*heads, *self.positions, *self.v_only)
        out = out.reshape([sizes[label] for label in order])
        return out.permute([order.index(label) for label in self.out]).contiguous()

    def _layout(self, inputs: Sequence[torch.Tensor]) -> MaskLayout:
        """The :class:`MaskLayout` of this task's mask chunks (in ``inputs``, as ``run``
        takes them)."""
        m = self.key_blocks
        seen = tuple(self._seen(inputs[1 + 2 * m:1 + 3 * m]) if m > 1 else range(m))
        whole = self._keys_whole(inputs, seen)
        sizes = dict(zip(self.q, whole[0].shape)) | dict(zip(self.k, whole[1].shape))
        mask = _mask(whole[3], self.mask, self.n, self.groups, self.positions, self.t, sizes)
        return MaskLayout(seen, key_ends(mask))

    def _attend(self, q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor,
                mask: torch.Tensor | None, ends: Sequence[int] | None) -> torch.Tensor:
        """``scaled_dot_product_attention`` of (1, heads, positions, E) queries: one call,
        or where ``ends`` is given (:func:`key_ends`) one per run of :data:`SUB_ROWS`
        positions over its leading ``ends[i]`` keys."""
        gqa = q4.shape[1] != k4.shape[1]
        if ends is None:
            return torch.nn.functional.scaled_dot_product_attention(
                q4, k4, v4, attn_mask=mask, scale=self.scale, enable_gqa=gqa)
        outs = []
        for i, end in enumerate(ends):
            rows = slice(i * SUB_ROWS, (i + 1) * SUB_ROWS)
            outs.append(torch.nn.functional.scaled_dot_product_attention(
                q4[:, :, rows], k4[:, :, :end], v4[:, :, :end],
                attn_mask=mask[..., rows, :end], scale=self.scale, enable_gqa=gqa))
        return torch.cat(outs, dim=2)

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


__all__ = ["MASKED_OUT", "SUB_ROWS", "AttentionChunk", "MaskLayout", "attention_kernel",
           "key_ends", "mask_layout"]
