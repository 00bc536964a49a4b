"""Transfers between ranks grouped into collectives: one ``all_to_all_single`` per exchange.

A repartition between two operations of a partitioned plan sends, from every rank, a slice
of its piece to every rank that reads it (``slices of X`` in the physical plan); partial
aggregates go to the piece's owner, and whole pieces to their readers. Sent one by one, each
transfer is a send on one rank and a receive on another. :func:`plan_exchanges` groups the
cross-rank transfers of one step (one producer's slices, pieces or partials) into
:class:`Exchange` rounds -- round ``k`` carries the ``k``-th chunk each rank sends each other
rank -- and the job makes ONE ``torch.distributed.all_to_all_single`` call per round, with
per-rank split sizes: every rank concatenates what it sends each peer (its own split is
empty) and splits what it receives into the chunks, so exactly the planned bytes cross and a
repartition is one collective instead of ``K (K - 1)`` point-to-point pairs. Under a memory
limit (``one_chunk_each``) a round carries at most one chunk sent and one received by each
rank: the chunk sent is passed as it is and the one received lands in the buffer the memory
plan allotted to it, so the collective needs no memory beyond the plan's.

Collectives pair up by call order, not by tag, so every rank must issue the job's exchanges
in the same order, and an exchange may not wait for itself:

* an exchange is formed only from transfers none of which depends (through any chain of ops
  on any rank) on another of them -- under a memory limit a receive may have to wait for an
  earlier one's chunk to be freed, which puts them in different rounds; a round that still
  waits on itself stays point-to-point;
* exchanges are ordered so that one depending on another comes after it (a topological order,
  ties by first op id): a rank issues exchange ``k`` once its own transfers of it are ready
  and exchanges ``0..k-1`` are issued, which never waits on a later exchange;
* without a memory limit, neighbours in that order that do not wait on each other are merged
  into one exchange (rounds of one step, or several steps' repartitions computed side by
  side): every collective is a point where all ranks wait for the slowest.

Every rank computes the same ops from the same plan, so every rank finds the same exchanges
in the same order.

>>> from tensorql.exec.memplan import Op
>>> from tensorql.exec.taskgraph import ChunkRef
>>> def send(i, src, dst, key):
...     return Op(i, "send", dst, ChunkRef(5, key), (), 64, "d2d", src_device=src)
>>> ops = [send(0, 0, 1, (0,)), send(1, 1, 0, (1,)), send(2, 0, 1, (2,))]
>>> [e.ops for e in plan_exchanges(ops, rank_of=lambda d: d)]
[(0, 1, 2)]
>>> [e.ops for e in plan_exchanges(ops, rank_of=lambda d: d, one_chunk_each=True)]
[(0, 1), (2,)]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tensorql.exec.memplan import Op

# a step's transfers become exchanges when they come from at least this many ranks: a
# single sender gains nothing from making every rank join a collective
MIN_SENDING_RANKS = 2


@dataclass(frozen=True)
class Exchange:
    """One round of the cross-rank transfers of one step (or of several steps that travel
    together), run as one ``all_to_all_single`` of the job: ``ops`` are the memory plan's
    transfer ops it carries (by op id, the order each rank concatenates and splits them in);
    ``step`` is the first of ``steps``."""

    index: int
    step: int
    ops: tuple[int, ...]
    steps: tuple[int, ...] = ()


def plan_exchanges(ops: Sequence[Op], rank_of: Callable[[int], int], *,
                   one_chunk_each: bool = False,
                   min_sending_ranks: int = MIN_SENDING_RANKS,
                   dtype_of: Callable[[Op], str] | None = None) -> tuple[Exchange, ...]:
    """The exchanges of a memory plan's ``ops`` (in their issue order); ``rank_of`` maps a
    device to its rank. Transfers left out of every exchange stay point-to-point.

    Round ``k`` of a step carries the ``k``-th transfer of each pair of ranks; with
    ``one_chunk_each`` (under a memory limit) a round carries at most one chunk sent and one
    received by each rank, so the chunks themselves are the collective's buffers. Otherwise
    rounds that follow one another in the issue order and do not wait on each other travel
    as one collective when their chunks have one dtype (``dtype_of``; all alike when None):
    a LLaMA block's query, key and value repartitions are one exchange, not three, and every
    exchange is a point where all ranks wait for the slowest."""
    by_step: dict[int, list[int]] = {}
    for op in ops:
        if op.kind == "send" and rank_of(op.src_device) != rank_of(op.device):
            by_step.setdefault(op.ref.step, []).append(op.id)
    groups: dict[tuple[int, int], list[int]] = {}  # (step, round) -> op ids
    for step, ids in by_step.items():
        if len({rank_of(ops[i].src_device) for i in ids}) < min_sending_ranks:
            continue
        rounds = _one_chunk_rounds(ops, ids, rank_of) if one_chunk_each else \
            _pair_rounds(ops, ids, rank_of)
        for i, k in zip(ids, rounds):
            groups.setdefault((step, k), []).append(i)
    if not groups:
        return ()
    candidates = sorted(groups, key=lambda g: groups[g][0])
    bit = {g: 1 << n for n, g in enumerate(candidates)}
    member = {i: g for g, ids in groups.items() for i in ids}
    ancestors = _ancestor_groups(ops, member, bit)
    # a round one of whose transfers waits on another of them cannot be one collective
    kept = [g for g in candidates if not any(ancestors[i] & bit[g] for i in groups[g])]
    order = _topological(kept, groups, ancestors, bit)
    runs = [[g] for g in order] if one_chunk_each else \
        _together(order, groups, ancestors, bit, ops, dtype_of)
    return tuple(Exchange(n, run[0][0], tuple(sorted(i for g in run for i in groups[g])),
                          tuple(dict.fromkeys(g[0] for g in run)))
                 for n, run in enumerate(runs))


def _together(order: list[tuple[int, int]], groups: dict[tuple[int, int], list[int]],
              ancestors: list[int], bit: dict[tuple[int, int], int], ops: Sequence[Op],
              dtype_of: Callable[[Op], str] | None) -> list[list[tuple[int, int]]]:
    """Consecutive rounds of ``order`` merged while none waits on another of its run (and
    their chunks share a dtype). Only neighbours merge: every round a run waits on then comes
    before the run, so issuing the run when all its transfers are ready never waits on a
    later exchange."""
    def dtype(g: tuple[int, int]) -> str | None:  # one step's chunks share one
        return dtype_of(ops[groups[g][0]]) if dtype_of is not None else None

    runs: list[list[tuple[int, int]]] = []
    run_bits = 0
    for g in order:
        if runs and dtype(g) == dtype(runs[-1][0]) and \
                not any(ancestors[i] & run_bits for i in groups[g]):
            runs[-1].append(g)
            run_bits |= bit[g]
        else:
            runs.append([g])
            run_bits = bit[g]
    return runs


def _pair_rounds(ops: Sequence[Op], ids: list[int], rank_of: Callable[[int], int]
                 ) -> list[int]:
    """The round of each transfer: the k-th one from a rank to another goes in round k."""
    seen: dict[tuple[int, int], int] = {}
    rounds = []
    for i in ids:
        pair = (rank_of(ops[i].src_device), rank_of(ops[i].device))
        rounds.append(seen.get(pair, 0))
        seen[pair] = rounds[-1] + 1
    return rounds


def _one_chunk_rounds(ops: Sequence[Op], ids: list[int], rank_of: Callable[[int], int]
                      ) -> list[int]:
    """The round of each transfer such that no rank sends or receives two chunks in one
    round: the first round (in op order) where both its ranks are free. Two transfers of
    one pair of ranks thus keep their order."""
    sending: list[set[int]] = []
    receiving: list[set[int]] = []
    rounds = []
    for i in ids:
        src, dst = rank_of(ops[i].src_device), rank_of(ops[i].device)
        k = next((k for k in range(len(sending))
                  if src not in sending[k] and dst not in receiving[k]), len(sending))
        if k == len(sending):
            sending.append(set())
            receiving.append(set())
        sending[k].add(src)
        receiving[k].add(dst)
        rounds.append(k)
    return rounds


def _ancestor_groups(ops: Sequence[Op], member: dict[int, tuple[int, int]],
                     bit: dict[tuple[int, int], int]) -> list[int]:
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


def _topological(kept: list[tuple[int, int]], groups: dict[tuple[int, int], list[int]],
                 ancestors: list[int], bit: dict[tuple[int, int], int]
                 ) -> list[tuple[int, int]]:
    """``kept`` rounds ordered so that a group waiting on another comes after it; groups
    caught in a cycle (two exchanges each waiting on the other's transfers through different
    ranks) are dropped and stay point-to-point."""
    waits_on = {s: 0 for s in kept}
    for s in kept:
        for i in groups[s]:
            waits_on[s] |= ancestors[i]
    before = {s: {t for t in kept if t != s and waits_on[s] & bit[t]} for s in kept}
    order: list[tuple[int, int]] = []
    placed: set[tuple[int, int]] = set()
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
