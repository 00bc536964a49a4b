"""Transfers between ranks grouped into collectives: one ``all_to_all_single`` per exchange.

A repartition between two operations of a partitioned plan sends, from every rank, a slice
of its piece to every rank that reads it (``slices of X`` in the physical plan); partial
aggregates go to the piece's owner, and whole pieces to their readers. Sent one by one, each
transfer is a send on one rank and a receive on another. :func:`plan_exchanges` groups the
cross-rank transfers of one step (one producer's slices, pieces or partials) into an
:class:`Exchange`: every rank concatenates what it sends to each peer and the job makes ONE
``torch.distributed.all_to_all_single`` call with per-rank split sizes, so exactly the
planned bytes cross (a rank's own split is empty) and a repartition is one collective, not
``K (K - 1)`` point-to-point pairs.

Collectives pair up by call order, not by tag, so every rank must issue the job's exchanges
in the same order, and an exchange may not wait for itself:

* an exchange is formed only from transfers none of which depends (through any chain of ops
  on any rank) on another of them -- under a memory limit a receive may have to wait for an
  earlier one's chunk to be freed; those stay point-to-point;
* exchanges are ordered so that one depending on another comes after it (a topological order,
  ties by first op id): a rank issues exchange ``k`` once its own transfers of it are ready
  and exchanges ``0..k-1`` are issued, which never waits on a later exchange.

Every rank computes the same ops from the same plan, so every rank finds the same exchanges
in the same order.

>>> from tensorql.exec.memplan import Op
>>> from tensorql.exec.taskgraph import ChunkRef
>>> def send(i, src, dst, key):
...     return Op(i, "send", dst, ChunkRef(5, key), (), 64, "d2d", src_device=src)
>>> ops = [send(0, 0, 1, (0,)), send(1, 1, 0, (1,))]
>>> [e.ops for e in plan_exchanges(ops, rank_of=lambda d: d)]
[(0, 1)]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tensorql.exec.memplan import Op

# a step's transfers become one exchange when they come from at least this many ranks: a
# single sender gains nothing from making every rank join a collective
MIN_SENDING_RANKS = 2


@dataclass(frozen=True)
class Exchange:
    """The cross-rank transfers of one step, run as one ``all_to_all_single`` of the job.

    ``ops`` are the memory plan's transfer ops it carries, by op id: the order in which
    each rank concatenates what it sends to one peer, and splits what it receives from one.
    """

    index: int
    step: int
    ops: tuple[int, ...]


def plan_exchanges(ops: Sequence[Op], rank_of: Callable[[int], int],
                   min_sending_ranks: int = MIN_SENDING_RANKS) -> tuple[Exchange, ...]:
    """The exchanges of a memory plan's ``ops`` (in their issue order); ``rank_of`` maps a
    device to its rank. Transfers left out of every exchange stay point-to-point."""
    groups: dict[int, list[int]] = {}
    for op in ops:
        if op.kind == "send" and rank_of(op.src_device) != rank_of(op.device):
            groups.setdefault(op.ref.step, []).append(op.id)
    groups = {step: ids for step, ids in groups.items()
              if len({rank_of(ops[i].src_device) for i in ids}) >= min_sending_ranks}
    if not groups:
        return ()
    candidates = sorted(groups, key=lambda step: groups[step][0])
    bit = {step: 1 << n for n, step in enumerate(candidates)}
    member = {i: step for step, ids in groups.items() for i in ids}
    ancestors = _ancestor_groups(ops, member, bit)
    # a group one of whose transfers waits on another of them cannot be one collective
    kept = [step for step in candidates
            if not any(ancestors[i] & bit[step] for i in groups[step])]
    order = _topological(kept, groups, ancestors, bit)
    return tuple(Exchange(n, step, tuple(groups[step])) for n, step in enumerate(order))


def _ancestor_groups(ops: Sequence[Op], member: dict[int, int],
                     bit: dict[int, int]) -> list[int]:
    """For every op, a bit mask of the groups having a transfer it (transitively) waits on.
    Ops are in simulated order, so an op's dependencies come before it."""
    masks = [0] * len(ops)
    for op in ops:
        mask = 0
        for dep in op.deps:
            if dep >= op.id:  # pragma: no cover - the memory plan orders ops by dependency
                raise AssertionError(f"op {op.id} depends on later op {dep}")
            mask |= masks[dep]
            if dep in member:
                mask |= bit[member[dep]]
        masks[op.id] = mask
    return masks


def _topological(kept: list[int], groups: dict[int, list[int]], ancestors: list[int],
                 bit: dict[int, int]) -> list[int]:
    """``kept`` steps ordered so that a group waiting on another comes after it; groups
    caught in a cycle (two exchanges each waiting on the other's transfers through different
    ranks) are dropped and stay point-to-point."""
    before = {s: {t for t in kept if t != s and any(ancestors[i] & bit[t] for i in groups[s])}
              for s in kept}
    order: list[int] = []
    placed: set[int] = set()
    remaining = list(kept)  # sorted by first op id: the tie-break
    while remaining:
        nxt = next((s for s in remaining if before[s] <= placed), None)
        if nxt is None:  # the rest wait on a cycle: they stay point-to-point
            break
        order.append(nxt)
        placed.add(nxt)
        remaining.remove(nxt)
    return order


__all__ = ["Exchange", "MIN_SENDING_RANKS", "plan_exchanges"]
