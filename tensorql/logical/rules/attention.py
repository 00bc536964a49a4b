"""Rule ``match_attention``: ``softmax(q . k [* scale] [+ mask]) . v`` becomes one
:class:`~tensorql.logical.plan.Attention` node (run by one fused chunk kernel per output
chunk, torch's ``scaled_dot_product_attention``: no scores relation in memory).

The lowering spells attention as four relational steps -- the scores (an aggregate of q
joined with k), an optional additive mask (a join), a softmax over the key label (its input
retiled to whole rows of keys), and the weighted values (an aggregate of the probabilities
joined with v) -- each materialising a (queries x keys) relation per head. Where that chain
stands alone (every intermediate read only by the next step, float32/float64), it is matched
by labels alone (no model knowledge): ``N`` labels in q, k and v (batch, key/value head),
``S`` labels only in q (query positions, query groups), ``E`` the contracted head dim of q
and k, ``T`` the softmax label (key positions, in k and v), ``V`` labels only in v.

>>> import torch
>>> from tensorql.einsum.graph import Constant, EinsumOp, SoftmaxOp
>>> from tensorql.grid import ChunkGrid
>>> from tensorql.logical.lower import lower
>>> def const(*shape):
...     return Constant(shape=shape, dtype="float32", value=torch.ones(shape),
...                     grid=ChunkGrid(shape, shape))
>>> scores = EinsumOp.build("bse,bte->bst", [const(2, 3, 4), const(2, 5, 4)])
>>> out = EinsumOp.build("bst,btf->bsf", [SoftmaxOp.build(scores, -1), const(2, 5, 6)])
>>> fused = match_attention(lower(out))
>>> fused.title, fused.labels.n, fused.labels.t, fused.labels.e
('Attention softmax over [t]', ('b',), ('t',), ("e'qk",))
"""

from __future__ import annotations

from tensorql.algebra import AggName, JoinName
from tensorql.logical.lower import retile
from tensorql.logical.plan import (
    Aggregate,
    Attention,
    AttentionLabels,
    Join,
    LogicalNode,
    Map,
    Rekey,
    Softmax,
    walk,
)
from tensorql.logical.rules.common import readers as readers_of
from tensorql.logical.rules.common import rebuild

NAME = "match_attention"
FLOATS = ("float32", "float64")
Labels = tuple[str, ...]


def match_attention(root: LogicalNode) -> LogicalNode:
    """``root`` with every attention chain that stands alone made one ``Attention`` node;
    ``root`` itself when there is none."""
    nodes = walk(root)
    counts = {key: len(ids) for key, ids in readers_of(nodes, root).items()}
    made, dropped = {}, set()
    for node in nodes:
        match = _match(node, counts)
        if match is not None:
            members, make = match
            made[id(node)] = make
            dropped |= {id(m) for m in members}
    return rebuild(root, made, frozenset(dropped))


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


def _match(out: LogicalNode, readers: dict[int, int]):
    """The attention chain ending at ``out`` as ``(members it replaces, maker)``, or None.
    Each node names its labels afresh (a consumer's input labels rename its producer's dims
    by position), so the chain's labels are translated to those of the last product (q's and
    k's contracted labels get names of their own)."""
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
    if any(src.relation.dtype not in FLOATS for src in sources) or \
            out.relation.dtype not in FLOATS:
        return None
    # a source the lowering retiled for this chain alone is read from before that copy
    copies = [src for src in sources if isinstance(src, Rekey) and readers.get(id(src)) == 1]
    sources = [src.input if src in copies else src for src in sources]
    labels = AttentionLabels(q=q_labels, k=k_labels, v=v_labels, mask=mask_labels,
                             out=out.relation.labels, n=n, s=s, e=e, t=t, v_only=v_only)
    scale = scale_map.scalar if scale_map is not None else 1.0

    def make(memo: dict[int, LogicalNode]) -> LogicalNode:
        rebuilt = [memo[id(src)] for src in sources]
        fed = [_fed(src, lab, out, e, t[0], rebuilt[1], k_labels)
               for src, lab in zip(rebuilt, labels.sources)]
        return Attention(out.relation, sources=tuple(fed), labels=labels, scale=scale,
                         rule=NAME)

    return copies + chain, make


def _fed(source: LogicalNode, labels: Labels, out: LogicalNode, e: Labels, key: str,
         k: LogicalNode, k_labels: Labels) -> LogicalNode:
    """``source`` (its dims named ``labels``) on the tiles the fused step reads it in: the
    output's tiles along the output's labels (one chunk of it feeds one output chunk), the
    head dim ``e`` whole, and along the keys ``key`` the tiles of k (a task takes every
    chunk along the keys of k, v and the mask, in the same blocks). Already so, it is
    itself; else a ``Rekey`` (or a constant's scan on those tiles)."""
    tiles = dict(zip(labels, source.relation.grid.tile))
    tiles |= {label: size for label, size in zip(labels, source.relation.shape) if label in e}
    tiles |= {label: tile for label, tile in zip(out.relation.labels, out.relation.grid.tile)
              if label in tiles}
    if key in tiles:
        tiles[key] = k.relation.grid.tile[k_labels.index(key)]
    return retile(source, labels, tiles)
